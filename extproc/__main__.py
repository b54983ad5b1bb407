import sys

from kairos.extproc.main import main

sys.exit(main())
