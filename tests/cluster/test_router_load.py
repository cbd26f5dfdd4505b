"""The load a router puts on each worker (what kv_aware weighs), on a real local Ray: a prompt
counts as queued and its prefix as being computed on its worker until its first token; then the
context of the request streaming from a decode worker counts there until it ends; whatever way
it ends, nothing stays counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import ray

from cluster.kv_index import KVIndex
from cluster.router import Router
from cluster.worker_choice import WorkerSlot
from engine.sampling_params import SamplingParams
from tests.cluster.cluster_fixtures import local_ray as start_local_ray
from tests.cluster.router_doubles import HandingPrefill
from worker_common.messages import GenerateRequest, PrefillResult, TokenDelta

PROMPT = list(range(1, 22))  # 21 tokens, 5 full pages of 4 a hit can reach


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with start_local_ray("duet-test-router-load"):
        yield


@ray.remote(num_cpus=0)
class ThreeTokens:
    """A decode worker that streams three tokens, or fails after the first (``fail``)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    async def _stream(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        n = len(req.prompt_token_ids)
        for i in range(3):
            if self.fail and i == 1:
                raise RuntimeError("this decode worker broke mid-stream")
            yield TokenDelta(req.request_id, [7], "x", "length" if i == 2 else None, n, i + 1)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        async for delta in self._stream(req):
            yield delta

    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        async for delta in self._stream(req):
            yield delta

    async def abort(self, *args: object) -> None:
        pass


def _router(prefill: list[WorkerSlot], decode: list[WorkerSlot]) -> Router:
    index = KVIndex([w.worker_id for w in prefill + decode])
    return Router(prefill, decode, policy="kv_aware", page_size=4, kv_index=index)


def _watch(router: Router, slot: WorkerSlot, req: GenerateRequest) -> list[tuple[int, int, int]]:
    """(queued prefill tokens, pending hashes, active tokens) on ``slot`` at each delta."""

    async def run() -> list[tuple[int, int, int]]:
        seen = []
        async for delta in router.generate(req):
            seen.append((slot.queued_prefill_tokens, len(slot.pending), slot.active_tokens))
            if delta.error is not None:
                break
        return seen

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("fail", "sampling"),
    [
        (False, SamplingParams()),
        (True, SamplingParams()),
        (False, SamplingParams(prompt_logprobs=0)),
    ],
    ids=["completes", "fails-mid-stream", "scores-its-prompt"],  # (the last: no block hashes)
)
def test_aggregated_load_moves_from_queued_to_active_and_is_gone_after(
    local_ray: None, fail: bool, sampling: SamplingParams
) -> None:
    d = WorkerSlot("d-0", ThreeTokens.remote(fail))
    router = _router([], [d])
    req = GenerateRequest("agg-1", PROMPT, sampling, time.time())
    seen = _watch(router, d, req)
    assert seen[0] == (0, 0, 21 + 1)  # at the first token: prefilled, its context held there
    if not fail:
        assert seen[1:] == [(0, 0, 23), (0, 0, 24)]
    assert (d.queued_prefill_tokens, len(d.pending), d.active_tokens, d.outstanding) == (0, 0, 0, 0)


def test_disaggregated_load_is_released_on_both_workers(local_ray: None) -> None:
    p = WorkerSlot("p-0", HandingPrefill.remote())
    d = WorkerSlot("d-0", ThreeTokens.remote())
    router = _router([p], [d])
    req = GenerateRequest("dis-1", PROMPT, SamplingParams(), time.time())
    seen = _watch(router, d, req)
    # (the first delta is P's first token, before any decode worker streams)
    assert [active for _, _, active in seen] == [0, 22, 23, 24]
    for w in (p, d):
        assert (w.queued_prefill_tokens, len(w.pending), w.active_tokens, w.outstanding) == (
            0,
            0,
            0,
            0,
        )
