"""HostOffload on its own, over a real device PagePool and host tier (CPU): a prefix's host pages
are pinned before the device pages for their load-backs are taken, so the offload that taking
one causes cannot overwrite a page about to be read; a load-back lands with its bytes; the
integrity check ties load-backs to their request's pages. (Through the manager:
tests/kvcache/test_host_tier.py.)"""

from __future__ import annotations

import pytest
import torch

from kvcache.host_offload import HostOffload
from kvcache.kv_buffer import allocate_buffers
from kvcache.kv_events import KVEvent, KVEventLog
from kvcache.page_pool import PagePool
from kvcache.prefix_match import PrefixMatch
from kvcache.request_pages import RequestPages
from kvcache.spec import NULL_PAGE
from tests.kvcache.conftest import group_spec

H1, H2 = 0x11, 0x22


CPU = torch.device("cpu")


def _offload(
    num_pages: int, host_pages: int
) -> tuple[HostOffload, PagePool, torch.Tensor, KVEventLog]:
    """A host tier of ``host_pages`` beneath one device pool, which offloads what it evicts."""
    spec = group_spec(num_pages=num_pages)
    buffers = allocate_buffers([spec], CPU)
    pool = PagePool(num_pages)
    events = KVEventLog(enabled=True)
    offload = HostOffload([spec], {"full": host_pages}, {"full": pool}, buffers, CPU, events)
    pool.on_evict = lambda page, block_hash: offload.offload("full", page, block_hash)
    return offload, pool, buffers["full"], events


def _cache(pool: PagePool, buffer: torch.Tensor, block_hash: int, value: float) -> int:
    """A device page holding ``value`` everywhere, registered under ``block_hash`` and evictable."""
    (page,) = pool.allocate(1)
    buffer[page] = value
    assert pool.register(page, block_hash)
    pool.free([page])
    return page


def test_a_load_back_pins_its_host_page_before_taking_its_device_page() -> None:
    offload, pool, buffer, _ = _offload(num_pages=2, host_pages=1)  # one usable device page
    page = _cache(pool, buffer, H1, 1.0)
    assert pool.allocate(1) == [page]  # evicts H1: offloaded to host page 0
    assert offload.pools["full"].lookup(H1) == 0
    buffer[page] = 2.0
    assert pool.register(page, H2)
    pool.free([page])  # H2 evictable: the page a load-back of H1 will take, offloading H2
    state = RequestPages.empty(["full"])
    state.pages["full"] = [NULL_PAGE]  # as the prefix lists a host position
    prefix = PrefixMatch(2, {"full": [0]}, [H1], 3, {"full": {0: 0}})
    assert offload.take_loads(prefix, {"full": [0]}, state) == 1
    # H2's offload found the only host page pinned: skipped, so H1's bytes were not overwritten.
    assert offload.pools["full"].lookup(H2) is None
    landed = offload.finish_allocation("r")
    assert [(i.host_page, i.device_page, i.block_hash) for i in landed] == [(0, page, H1)]
    assert state.pages["full"] == [page]
    assert (buffer[page] == 1.0).all()  # the load-back's bytes are H1's
    assert not offload.loading("r") and offload.poll() == [] and offload.wait("r") == []
    offload.check_integrity({"r": state})


def test_host_offload_records_the_host_tier_s_events() -> None:
    offload, pool, buffer, events = _offload(num_pages=2, host_pages=1)
    page = _cache(pool, buffer, H1, 1.0)
    assert pool.allocate(1) == [page]  # H1 offloaded
    buffer[page] = 2.0
    assert pool.register(page, H2)
    pool.free([page])
    pool.allocate(1)  # H2 offloaded over H1: the host drops H1
    assert events.drain() == [
        KVEvent("stored", "host", "full", [H1]),
        KVEvent("removed", "host", "full", [H1]),
        KVEvent("stored", "host", "full", [H2]),
    ]
    assert offload.cached_hashes("full") == [H2]
    stats = offload.stats("full", page_size=2)
    assert (stats.used, stats.offloaded, stats.drops) == (1, 2, 1)


def test_host_offload_needs_every_group() -> None:
    spec = group_spec()
    buffers = allocate_buffers([spec], torch.device("cpu"))
    with pytest.raises(ValueError, match="host_tier_pages must name the groups"):
        HostOffload([spec], {"swa": 1}, {"full": PagePool(6)}, buffers, CPU, KVEventLog())
