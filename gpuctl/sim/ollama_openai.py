"""The simulated Ollama's OpenAI-compatible endpoints: ``/v1/models`` and
``/v1/chat/completions`` (JSON or SSE), as Ollama serves them.

Standard library and ``gpuctl.sim`` only (see ``gpuctl.sim.ollama``).
"""

from __future__ import annotations

import json
import time
import uuid
from http import HTTPStatus
from typing import Any

from gpuctl.sim.ollama_http import REPLY, HandlerBase
from gpuctl.sim.ollama_models import normalize_model
from gpuctl.sim.openai_shapes import finish_reason


class OpenAIEndpoints(HandlerBase):
    """``/v1/models`` and ``/v1/chat/completions``."""

    def _v1_models(self, _body: dict[str, Any]) -> None:
        data = [
            {"id": m["name"], "object": "model", "created": 0, "owned_by": "library"}
            for m in self.ollama.tags()
        ]
        self._json(HTTPStatus.OK, {"object": "list", "data": data})

    def _v1_chat(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if not isinstance(model, str) or not model.strip():
            self._openai_error(HTTPStatus.BAD_REQUEST, "model is required", "invalid_request_error")
            return
        name = normalize_model(model)
        if name not in self.ollama.library:
            self._openai_error(
                HTTPStatus.NOT_FOUND,
                f'model "{model}" not found, try pulling it first',
                "api_error",
            )
            return
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            self._openai_error(
                HTTPStatus.BAD_REQUEST, "messages must be a non-empty list", "invalid_request_error"
            )
            return
        tokens = self._tokens(name, body.get("max_tokens", body.get("max_completion_tokens")))
        finish = finish_reason(len(tokens), len(REPLY.split(" ")))
        prompt = sum(
            len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict)
        )
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": len(tokens),
            "total_tokens": prompt + len(tokens),
        }
        ident = f"chatcmpl-{uuid.uuid4().hex[:12]}"
        created = int(time.time())
        try:
            with self.ollama.use(name, None):
                if body.get("stream"):
                    self._v1_stream(
                        ident, created, name, tokens=tokens, finish=finish, usage=usage, body=body
                    )
                    return
                for _ in tokens:
                    time.sleep(self.ollama.token_delay_s)
                message = {"role": "assistant", "content": "".join(tokens)}
                choice = {"index": 0, "message": message, "finish_reason": finish}
                self._json(
                    HTTPStatus.OK,
                    {
                        "id": ident,
                        "object": "chat.completion",
                        "created": created,
                        "model": name,
                        "system_fingerprint": "fp_ollama",
                        "choices": [choice],
                        "usage": usage,
                    },
                )
        except RuntimeError as err:
            self._openai_error(HTTPStatus.INTERNAL_SERVER_ERROR, str(err), "api_error")

    def _v1_stream(
        self,
        ident: str,
        created: int,
        name: str,
        *,
        tokens: list[str],
        finish: str,
        usage: dict[str, int],
        body: dict[str, Any],
    ) -> None:
        self._start_chunks("text/event-stream")

        def event(choices: list[dict[str, Any]], **extra: Any) -> None:
            obj = {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": name,
                "system_fingerprint": "fp_ollama",
                "choices": choices,
                **extra,
            }
            self._chunk(f"data: {json.dumps(obj)}\n\n".encode())

        for tok in tokens:
            time.sleep(self.ollama.token_delay_s)
            delta = {"role": "assistant", "content": tok}
            event([{"index": 0, "delta": delta, "finish_reason": None}])
        event(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": finish}]
        )
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            event([], usage=usage)
        self._chunk(b"data: [DONE]\n\n")
        self._end_chunks()
