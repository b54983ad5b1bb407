"""The simulator's benchmarks: no processes, no network; each runs as ``python -m bench.sim.<name>``."""
