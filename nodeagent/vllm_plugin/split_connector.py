"""vLLM's NixlConnector, with a decode side that pulls a split's prefix and no more.

Every Kairos vLLM node loads it (:mod:`kairos.launcher.vllm_node`): ``--kv-transfer-config``
keeps ``"kv_connector": "NixlConnector"`` and adds ``"kv_connector_module_path":
"kairos.nodeagent.vllm_plugin.split_connector"``; vLLM's factory then takes the class of that
name from this module instead of its own.

**The split route.** Hop 1 sends the prefill node the prompt's first k tokens (``max_tokens=1``,
``do_remote_decode``); its answer's ``kv_transfer_params`` carry ``remote_num_tokens`` = k and
the k tokens' blocks. Hop 2 sends the decode node the whole prompt (l tokens) with those params
and the chunk schedule of the other l - k. Stock vLLM 0.32's decode side
(``NixlPullConnectorScheduler.get_num_new_matched_tokens``, its ``do_remote_prefill`` branch)
takes the whole prompt as remote: it would load ``_get_remote_prefill_token_count(l)`` tokens into
l tokens' worth of blocks from a prefiller that holds k tokens' (the worker's block pairing asserts
the decoder never asks for more blocks than the prefiller has): its engine core fails, an HTTP 500
and the server gone, whatever ``kv_load_failure_policy`` says. This connector's decode side loads
``k - computed`` instead, where computed is the decode node's own (block-aligned) prefix hit;
vLLM's scheduler then finds ``num_computed_tokens = k`` once the blocks arrive and prefills the
rest itself, and :class:`~kairos.nodeagent.vllm_plugin.scheduler.KairosScheduler`
holds that tail to the request's chunk schedule like any deflected prefill.

Only the count changes. A keep's hop 1 computed the whole prompt (``remote_num_tokens`` = l), so
its hop 2, a deflection (no params) and a prefill hop (``do_remote_decode``) take vLLM's own path
unchanged. The pull itself is vLLM's: the scheduler allocates blocks for the loaded tokens only,
the worker pairs those (the tokens past the decoder's prefix hit) with the prefiller's blocks by
their end, as for a keep whose prompt the decoder partly caches, and a failed pull is recomputed
(``kv_load_failure_policy``). That pairing holds when the prefiller's blocks hold exactly the k
tokens it computed, which vLLM's keep path assumes as well.

**Where it does not apply.** A model whose KV is not plain full attention (sliding-window or
Mamba groups, whose blocks are clipped or hold running state) or whose prefiller stops short of
the prompt (``_prefill_backoff``: Mamba, multi-token-prediction lookahead) pairs blocks
differently; there a split's decode side loads nothing and computes the whole prompt (the right
output, the prefill node's work lost), with a warning.

**What else vLLM offered.** Its other extension points were weighed: (1) the bidirectional
(``do_remote_decode`` on the decode hop) branch of the same method already honours
``remote_num_tokens``, but it is the turn-2 read-back of a decoder's cache, with its own TTL,
threshold and notifications, not a prefill hand-off; (2) a ``MultiConnector`` or an offloading
connector moves KV through a store, not the hop protocol Kairos's sidecar speaks; (3) a prefill
node that computes k of l tokens (the prompt sent whole with a ``max_tokens``-style cap) has no
vLLM switch; sending it the first k tokens is plain vLLM. So the change is the one method,
through ``kv_connector_module_path``, the extension point vLLM documents for connectors of one's
own. The class keeps vLLM's name because vLLM checks NIXL's presence by connector name
(``has_connector("NixlConnector")``: the NIXL-specific config checks, the CPU platform's cache
layout).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnector, NixlPullConnectorScheduler

from kairos.nodeagent.vllm_plugin.remote_prefix import split_prefix_tokens

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kairos")  # under vLLM's logger, so it shows in its log

MODULE_PATH = __name__  # the kv-transfer config's kv_connector_module_path


class SplitPullScheduler(NixlPullConnectorScheduler):
    """NIXL's pull scheduler, loading only the prefix a split's prefill node computed."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        # Blocks that hold each token's KV and nothing else, the prefiller's covering its whole
        # prompt: a prefix of them is a prefix of the prompt.
        self.pulls_split_prefixes = not (
            self._has_mamba or self._is_hma_required or self._bounded_replay or self._prefill_backoff()
        )
        self._warned_unsplittable = False

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        k = split_prefix_tokens(params, request.num_prompt_tokens)
        if k is None or not params or not params.get("do_remote_prefill"):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not self.pulls_split_prefixes:
            if not self._warned_unsplittable:
                self._warned_unsplittable = True
                log.warning(
                    "kairos: this model's KV layout cannot take a split prefix over NIXL; split requests "
                    "are prefilled here in full (request %s)",
                    request.request_id,
                )
            return 0, False  # update_state_after_alloc still tells the prefiller to free its blocks
        count = k - num_computed_tokens  # no backoff here: vLLM would load the whole prompt
        return (count, True) if count > 0 else (0, False)


class NixlConnector(NixlPullConnector):
    """vLLM's NixlConnector (pull mode) with :class:`SplitPullScheduler` on its scheduler side."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:  # the stock one is inert until its handshake listener starts
            self.connector_scheduler = SplitPullScheduler(vllm_config, self.engine_id, kv_cache_config)

    @property
    def pulls_split_prefixes(self) -> bool:
        """Whether a split's hop 2 pulls its prefix here (False: it is prefilled here in full)."""
        scheduler = self.connector_scheduler
        return isinstance(scheduler, SplitPullScheduler) and scheduler.pulls_split_prefixes
