"""Kairos: load-aware prefill deflection for disaggregated LLM serving.

One import name for the whole distribution. Its packages, lowest first (an arrow points down
only; ``tests/unit/test_layers.py`` checks it):

- :mod:`kairos.common`    the shared ground: wire contracts, defaults, errors and their HTTP
                          mapping, config loading, Redis client helpers, process runtime
- :mod:`kairos.core`      the pure decision core: node state, latency models, the TTFT
                          estimator and chunk-schedule search (Algorithm 1), policies, the
                          dispatch overlay; no clock, no I/O
- :mod:`kairos.api`       the OpenAI surface: request parsing, limits, exact token counting,
                          batches split and merged as vLLM answers them
- :mod:`kairos.traffic`   what a run sends: ``RequestSpec``, the seeded synthetic workloads and
                          SLO class mixes, trace files
- :mod:`kairos.extproc`   the gateway (folder ``extproc/``): Envoy ext_proc server, dispatcher,
                          cluster membership and its Redis poller, reservations, feedback
- :mod:`kairos.nodeagent` what runs on a vLLM node (folder ``nodeagent/``): heartbeat publisher,
                          decode-side sidecar, vLLM plugins
- :mod:`kairos.sim`       the engine model, simulator, emulated vLLM (folder ``sim/``)
- :mod:`kairos.profiling` one-time profiling and model fitting (folder ``profiling/``)
- :mod:`kairos.launcher`  the ``kairos`` CLI on top: ``kairos up``, replay, local clusters
"""
