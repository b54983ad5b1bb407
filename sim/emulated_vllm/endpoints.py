"""The rest of vLLM's API on the emulated node: models, health, version, tokenize, detokenize."""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from kairos.api.openai_request import NotFoundError, RequestError
from kairos.api.tokenizer import PromptTokenizer
from kairos.sim.emulated_vllm.config import EMULATED_VLLM_VERSION, EmulatedNodeConfig
from kairos.sim.emulated_vllm.validation import is_int, json_object
from kairos.sim.realtime import RealtimeEngine


class VllmEndpoints:
    """:class:`~kairos.sim.emulated_vllm.node.EmulatedNode`'s answers on the rest of vLLM's API:
    ``/v1/models``, ``/health``, ``/version``, ``/tokenize`` and ``/detokenize``."""

    # The node's, set by EmulatedNode (engine: its property, the running engine or a 503).
    config: EmulatedNodeConfig
    tokenizer: PromptTokenizer
    created: int
    engine: RealtimeEngine

    # -- other endpoints ---------------------------------------------------------------------
    async def models_list(self, request: web.Request) -> web.Response:
        cfg = self.config
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.model,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "vllm",
                        "root": cfg.model_dir,
                        "parent": None,
                        "max_model_len": cfg.max_model_len,
                        "permission": [
                            {
                                "id": f"modelperm-{uuid.uuid4().hex}",
                                "object": "model_permission",
                                "created": self.created,
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                ],
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        _ = self.engine  # 503 when the step loop is not running
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        """GET /version: vLLM's ``{"version": ...}``, of the vLLM release this node emulates."""
        return web.json_response({"version": EMULATED_VLLM_VERSION})

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize as vLLM 0.32 answers it (``serve/tokenize``): a ``prompt`` is encoded
        with special tokens unless ``add_special_tokens`` is false; ``messages`` are rendered
        with the chat template and encoded without them unless it is true."""
        body = json_object(await request.read())
        self._check_model(body)
        add_special = body.get("add_special_tokens")
        if add_special is not None and not isinstance(add_special, bool):
            raise RequestError("add_special_tokens must be a boolean", "add_special_tokens")
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list):
                raise RequestError("messages must be an array", "messages")
            text = self.tokenizer.render_chat(
                messages,
                body.get("add_generation_prompt", True) is not False,
                continue_final_message=body.get("continue_final_message") is True,
                tools=body.get("tools"),
                template_kwargs=body.get("chat_template_kwargs") or {},
            )
            tokens = self.tokenizer.encode(text, add_special_tokens=add_special is True)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise RequestError("prompt must be a string", "prompt")
            tokens = self.tokenizer.encode(prompt, add_special_tokens=add_special is not False)
        strs = None
        if body.get("return_token_strs") is True:
            strs = [self.tokenizer.raw_tokenizer.id_to_token(t) for t in tokens]
        return web.json_response(
            {"count": len(tokens), "max_model_len": self.config.max_model_len, "tokens": tokens, "token_strs": strs}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize: ``{"prompt": text}`` for ``tokens`` (special tokens kept, as vLLM)."""
        body = json_object(await request.read())
        self._check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(is_int(t) and t >= 0 for t in tokens):
            raise RequestError("tokens must be an array of non-negative integers", "tokens")
        bad = next((t for t in tokens if t >= self.tokenizer.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is out of vocabulary", "tokens")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model and model != self.config.model:  # vLLM serves an empty name as its own model
            raise NotFoundError(f"The model `{model}` does not exist.")
