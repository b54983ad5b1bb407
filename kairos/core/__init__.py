"""The pure decision core: node state, latency models, Algorithm 1, policies, the dispatch overlay.

Clock-free and I/O-free: the gateway, the simulator, the profiler and the vLLM plugin all call
the same functions with their own notion of ``now``. Imports only :mod:`kairos.common`.
"""
