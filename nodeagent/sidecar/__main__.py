"""``python -m kairos.nodeagent.sidecar``: run a sidecar (see :mod:`kairos.nodeagent.sidecar.service`)."""

import sys

from kairos.nodeagent.sidecar.service import main

if __name__ == "__main__":
    sys.exit(main())
