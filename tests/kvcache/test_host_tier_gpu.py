"""The KV host tier on a CUDA device: pinned host pages, offloads on their own stream (the model's
stream waits for them, the eviction does not), load-backs that land by event. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from kvcache.manager import KVCacheManager
from tests.kvcache.conftest import group_spec
from tests.kvcache.test_host_tier import A, B

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def run_on_device(m: KVCacheManager, rid: str, tokens: list[int]) -> None:
    """Admit, write each slot's value (token + 1) on the model's stream, commit, free."""
    match = m.match_prefix(tokens)
    assert m.allocate_slots(rid, len(tokens), match)
    m.wait_loads(rid)
    for g, pages in m.page_ids(rid).items():
        for i in range(match.num_tokens, len(tokens)):
            m.buffers[g][pages[i // m.page_size], :, :, :, i % m.page_size] = tokens[i] + 1
    m.commit(rid, tokens, len(tokens), prompt_done=True)
    m.free(rid)


def test_offload_and_load_back_through_pinned_memory() -> None:
    m = KVCacheManager(
        [group_spec(num_pages=5, page_size=2)], "all_reusable", "cuda", host_tier_pages={"full": 2}
    )
    tier = m.host_tier
    assert tier is not None and tier.buffers["full"].is_pinned()
    run_on_device(m, "a", A)
    run_on_device(m, "b", B)  # evicts A's last page: offloaded on the store stream
    m.wait_offloads()
    assert torch.equal(tier.buffers["full"][0, 0, 0, 0, :, 0], torch.tensor([4.0, 4.0]))
    match = m.match_prefix(A + [9])
    assert match.host_pages == {"full": {2: 0}}
    assert m.allocate_slots("c", 7, match, num_computed_tokens=6)
    m.wait_loads("c")  # its own load-back only
    assert not m.loads_pending("c")
    page = m.page_ids("c")["full"][2]
    assert torch.equal(m.buffers["full"][page, 0, 0, 0, :, 0].cpu(), torch.tensor([4.0, 4.0]))
    host = m.stats().groups["full"].host
    assert host is not None and (host.loaded_back, host.pinned) == (1, 0)
    m.free("c")
    m.check_integrity()


def test_a_load_back_whose_copy_finished_is_landed_when_the_request_is_let_compute() -> None:
    """The scheduler asks ``loads_pending`` once after the allocation: when the copy has already
    finished by then, the answer lets the request compute, so the pages must be landed (indexed
    on the device, the host page unpinned) by that answer, not by a later poll that the
    scheduler no longer makes for it. (They stayed unlanded until the request was freed: a
    window group could release a loaded page meanwhile as a plain free page, and the late
    landing indexed whatever was written into it by then.)"""
    m = KVCacheManager(
        [group_spec(num_pages=5, page_size=2)], "all_reusable", "cuda", host_tier_pages={"full": 2}
    )
    tier = m.host_tier
    assert tier is not None
    run_on_device(m, "a", A)
    run_on_device(m, "b", B)  # evicts A's last page to the host tier
    m.wait_offloads()
    match = m.match_prefix(A + [9])
    assert match.host_pages == {"full": {2: 0}}
    assert m.allocate_slots("c", 7, match, num_computed_tokens=6)
    torch.cuda.synchronize()  # the load-back's copy has finished
    assert not m.loads_pending("c")
    assert tier.pending_loads() == {}  # landed by that answer
    page = m.page_ids("c")["full"][2]
    assert m.match_prefix(A + [9]).page_ids["full"][2] == page  # indexed on the device
    host = m.stats().groups["full"].host
    assert host is not None and host.pinned == 0
    m.free("c")
    m.check_integrity()
