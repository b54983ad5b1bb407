"""Kairos plugins for a real vLLM server (the paper's §5.3-5.4).

Installed into the vLLM environment with the ``kairos-gateway`` package; vLLM finds them by
entry point or by ``--scheduler-cls``:

- :mod:`.scheduler` -- ``KairosScheduler``: honours a deflected request's chunk schedule
  (``vllm_xargs.kairos_chunk_schedule``) and per-step budget, reports the engine state and
  records steps;
- :mod:`.validator` -- a no-op logits processor whose ``validate_params`` rejects a malformed
  schedule in the API server with an HTTP 400, before it reaches the engine;
- :mod:`.split_connector` -- vLLM's NixlConnector (``kv_connector_module_path``), whose decode
  side pulls only the prefix a split's prefill node computed (:mod:`.remote_prefix` reads it);
- :mod:`.engine_state`, :mod:`.recorder`, :mod:`.state_server`, :mod:`.remote_prefix` -- the
  vLLM-free parts (the heartbeat snapshot, the step log, the local HTTP channel, a split's k), so
  they are tested without vLLM installed; what they parse and write (schedules, engine state, step records) is
  :mod:`kairos.common.contracts`'.

Only :mod:`.scheduler`, :mod:`.validator` and :mod:`.split_connector` import vLLM.
"""
