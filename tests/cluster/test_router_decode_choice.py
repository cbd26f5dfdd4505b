"""Which decode worker takes a prefilled request, through the router on a real local Ray: with
the workers' caches indexed (kv_aware), the one holding the prompt's prefix, since D pulls only
what it does not hold; without an index, the least loaded."""

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
from kvcache.kv_events import KVEvent
from kvcache.spec import FULL_GROUP
from tests.cluster.cluster_fixtures import local_ray as start_local_ray
from tests.cluster.router_doubles import HandingPrefill, collect
from worker_common.messages import GenerateRequest, PrefillResult, TokenDelta


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    with start_local_ray("duet-test-router-decode-choice"):
        yield


@ray.remote(num_cpus=0)
class NamedDecode:
    """A decode worker that answers with its name as the text of the last token."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def decode(self, req: GenerateRequest, pre: PrefillResult) -> AsyncIterator[TokenDelta]:
        yield TokenDelta(req.request_id, [7], self.name, "length", len(req.prompt_token_ids), 2)

    async def abort(self, *args: object) -> None:
        pass


PROMPT = list(range(1, 22))  # 21 tokens: 5 full pages of 4 a worker's hit can reach


def served_by(router: Router, rid: str) -> str:
    req = GenerateRequest(rid, PROMPT, SamplingParams(), time.time())
    return asyncio.run(collect(router, req))[-1].text


def test_a_prefilled_request_goes_to_the_decode_worker_holding_its_prompt(
    local_ray: None,  # noqa: F811
) -> None:
    prefill = [WorkerSlot("p-0", HandingPrefill.remote())]
    decode = [WorkerSlot(f"d-{i}", NamedDecode.remote(f"d-{i}")) for i in range(3)]
    for w in decode:
        w.free_pages = 100
    index = KVIndex([w.worker_id for w in prefill + decode])
    router = Router(prefill, decode, policy="kv_aware", page_size=4, kv_index=index)
    hashes = router.choice.block_hashes(GenerateRequest("h", PROMPT, SamplingParams(), 0.0))
    assert hashes is not None and len(hashes) == 5
    index.apply("d-2", [KVEvent("stored", "device", FULL_GROUP, hashes[:3])])
    index.apply("d-1", [KVEvent("stored", "device", FULL_GROUP, hashes[:1])])
    assert served_by(router, "r1") == "d-2"  # (without the index's word: d-0, the first)
    # Load still comes first: d-2 busy, the next most cached.
    decode[2].outstanding = 1
    assert served_by(router, "r2") == "d-1"
    # Without an index (load_balance): the most free pages, caches unknown.
    decode[2].outstanding = 0
    decode[0].free_pages = 200
    plain = Router(prefill, decode, page_size=4)
    assert served_by(plain, "r3") == "d-0"
