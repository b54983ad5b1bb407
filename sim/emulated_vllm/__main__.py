"""``python -m kairos.sim.emulated_vllm``: run an emulated vLLM node (see :mod:`kairos.sim.emulated_vllm.service`)."""

import sys

from kairos.sim.emulated_vllm.service import main

if __name__ == "__main__":
    sys.exit(main())
