"""Benchmarks on a real cluster on this machine (Envoy, Redis, dispatchers, sidecars, emulated or
real vLLM); each runs as ``python -m bench.live.<name>``."""
