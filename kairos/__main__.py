import sys

from kairos.launcher.cli import main

sys.exit(main())
