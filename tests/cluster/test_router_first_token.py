"""The router's first delta of a disaggregated request, made of the prefill worker's
PrefillResult: the first token and what P says of the prompt (without Ray: a prefill handle
whose call answers at once)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from cluster.router import Router
from cluster.worker_choice import WorkerSlot
from engine.sampling_params import SamplingParams
from worker_common.messages import GenerateRequest, PrefillResult


def prefill_handle(result: PrefillResult) -> SimpleNamespace:
    """An actor handle as the router calls it: ``prefill.remote(req)`` is awaitable."""

    async def prefill(req: GenerateRequest) -> PrefillResult:
        return result

    return SimpleNamespace(prefill=SimpleNamespace(remote=prefill))


def test_the_first_delta_says_how_much_of_the_prompt_p_read_from_its_prefix_cache() -> None:
    """P's prefix hit goes to the client with the first token (OpenAI's cached_tokens); the
    request ended at that token on P, so it is the only delta."""
    pre = PrefillResult("r", 5, "x", "length", ticket=None, num_cached_tokens=8)
    router = Router([WorkerSlot("p-0", prefill_handle(pre))], [WorkerSlot("d-0", None)])
    req = GenerateRequest("r", list(range(1, 11)), SamplingParams(max_tokens=1), time.time())

    async def collect() -> list:
        return [d async for d in router.generate(req)]

    (first,) = asyncio.run(collect())
    assert (first.token_ids, first.finish_reason) == ([5], "length")
    assert (first.num_prompt_tokens, first.num_cached_tokens) == (10, 8)
