"""The HTTP edge's test backend: ``WorkerBackend``, the server's ``ServingBackend`` over one real
DecodeWorker (aggregated mode, the embedded model) without Ray or the router, so every case is one
request; ``backend`` and ``http`` (tests/cluster/conftest.py) serve it. Plus the bodies and the
event parsing the HTTP tests share."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from decode_worker.worker import DecodeWorker
from engine.loaders.generation_defaults import GenerationDefaults
from worker_common.messages import GenerateRequest, TokenDelta

MODEL = "smollm2"


class WorkerBackend:
    """``ServingBackend`` over one DecodeWorker, as the router's aggregated path calls it; it
    keeps every GenerateRequest the server made."""

    def __init__(self, worker: DecodeWorker) -> None:
        engine = worker.loop.engine
        self.worker = worker
        self.tokenizer = engine.tokenizer
        self.model_name = MODEL
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.requests: list[GenerateRequest] = []
        self.sampling_defaults = GenerationDefaults()
        self.has_tokenizer = True
        self.request_timeout_s = 600.0

    async def start(self) -> None: ...
    async def stop(self) -> None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens)

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.id_to_token(t) or "" for t in token_ids]

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return self.tokenizer.encode_chat(
            messages,
            add_generation_prompt,
            continue_final_message=continue_final_message,
            variables=template_kwargs,
        )

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self.requests.append(request)
        return self.worker.generate(request)

    async def abort(self, request_id: str) -> None:
        await self.worker.abort(request_id)

    async def reset_prefix_cache(self, host_tier: bool) -> dict[str, bool | str]:
        reset = self.worker.loop.call(lambda engine: engine.reset_prefix_cache(host_tier))
        return {self.worker.worker_id: bool(await asyncio.wrap_future(reset))}

    async def health(self) -> dict[str, Any]:
        return {"healthy": True}

    async def metrics_text(self) -> bytes:
        return b""

    async def perf_metrics(self) -> list[dict[str, Any]]:
        return []

    async def iteration_stats(self) -> list[dict[str, Any]]:
        return []

    async def transfer_stats(self) -> list[dict[str, Any]]:
        return []


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
