"""The traffic a run sends: one request as a workload or trace describes it (``requests``), the
seeded synthetic workloads and SLO class mixes (``workloads``), and recorded traces read and
written (``traces``).

What the simulator runs, what the replay client sends to a live cluster, and what profiling and
the benchmarks size their runs with, so none of them needs another to describe a request.
Imports only :mod:`kairos.common`.
"""
