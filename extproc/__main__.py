import sys

from extproc.main import main

sys.exit(main())
