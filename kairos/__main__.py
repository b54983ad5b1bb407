import sys

from kairos.cli import main

sys.exit(main())
