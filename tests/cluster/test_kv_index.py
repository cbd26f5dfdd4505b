"""KVIndex: a worker's findable blocks from its KV events, and a prompt's cached prefix by tier."""

from __future__ import annotations

import pytest

from cluster.kv_index import CachedPrefix, KVIndex
from kvcache.kv_events import KVEvent


def test_events_in_order_give_the_prefix_by_tier() -> None:
    index = KVIndex(["p-0"])
    index.apply(
        "p-0",
        [
            KVEvent("stored", "device", "full", [1, 2, 3]),
            KVEvent("removed", "device", "full", [3]),
            KVEvent("stored", "host", "full", [3]),
        ],
    )
    assert index.cached_prefix("p-0", [1, 2, 3, 4], 4) == CachedPrefix(device_pages=2, host_pages=1)
    assert index.cached_prefix("p-0", [2, 3], 4) == CachedPrefix(1, 1)  # a run from any block
    assert index.cached_prefix("p-0", [5, 1, 2], 4) == CachedPrefix()  # the first page is needed
    assert index.cached_prefix("p-0", [1, 4, 2], 4).num_pages == 1  # stops at the first miss
    index.apply("p-0", [KVEvent("removed", "host", "full", [3])])
    assert index.cached_prefix("p-0", [1, 2, 3], 4) == CachedPrefix(2, 0)
    assert index.batches == {"p-0": 2} and index.rebuilds == {"p-0": 0}


def test_a_rebuild_replaces_and_forget_empties() -> None:
    index = KVIndex(["d-0"])
    index.apply("d-0", [KVEvent("stored", "device", "full", [1, 2])])
    index.rebuild("d-0", {"full": {"device": [7], "host": [8]}})
    assert index.cached_prefix("d-0", [1], 4) == CachedPrefix()
    assert index.cached_prefix("d-0", [7, 8], 4) == CachedPrefix(1, 1)
    assert index.rebuilds == {"d-0": 1}
    index.forget("d-0")
    assert index.cached_prefix("d-0", [7, 8], 4) == CachedPrefix()


def test_a_hybrid_prefix_is_what_the_worker_itself_would_find() -> None:
    """Full groups from the first page, then each window group must hold the pages its window
    reads before the hit (kvcache/prefix_match.py): a decode worker holds only the last window of
    a prompt it received, so its full group alone promised hits it could not take."""
    index = KVIndex(["d-0"])
    # window 9 on pages of 4: a hit needs the 2 pages before it in swa_9
    index.apply(
        "d-0",
        [
            KVEvent("stored", "device", "full", [1, 2, 3, 4, 5, 6]),
            KVEvent("stored", "device", "swa_9", [5, 6]),  # what D kept of a received prompt
        ],
    )
    assert index.cached_prefix("d-0", [1, 2, 3, 4, 5, 6], 4) == CachedPrefix(6, 0)
    assert index.cached_prefix("d-0", [1, 2, 3, 4, 5], 4) == CachedPrefix()  # window lacks 3, 4
    index.apply("d-0", [KVEvent("stored", "host", "swa_9", [3, 4])])
    # the window reads pages 4 (host) and 5 (device) before a hit of 5 pages
    assert index.cached_prefix("d-0", [1, 2, 3, 4, 5], 4) == CachedPrefix(4, 1)
    # no full group (every layer windowed): a hit wherever the window's pages are held
    index.rebuild("d-0", {"swa_9": {"device": [5, 6]}})
    assert index.cached_prefix("d-0", [1, 2, 3, 4, 5, 6], 4) == CachedPrefix(6, 0)
    assert index.cached_prefix("d-0", [1, 2, 3, 4, 5, 6, 7], 4) == CachedPrefix(6, 0)
    assert index.cached_prefix("d-0", [1, 2, 3, 4, 5], 4) == CachedPrefix()


def test_an_unknown_medium_is_refused() -> None:
    index = KVIndex(["p-0"])
    with pytest.raises(ValueError, match="unknown KV event medium 'disk'"):
        index.apply("p-0", [KVEvent("stored", "disk", "full", [1])])  # type: ignore[arg-type]
