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
            KVEvent("stored", "device", "swa_8", [9]),
        ],
    )
    assert index.cached_prefix("p-0", [1, 2, 3, 4]) == CachedPrefix(device_pages=2, host_pages=1)
    assert index.cached_prefix("p-0", [2, 3]) == CachedPrefix(1, 1)  # a run from any block
    assert index.cached_prefix("p-0", [5, 1, 2]) == CachedPrefix()  # the first page must be there
    assert index.cached_prefix("p-0", [1, 4, 2]).num_pages == 1  # stops at the first miss
    index.apply("p-0", [KVEvent("removed", "host", "full", [3])])
    assert index.cached_prefix("p-0", [1, 2, 3]) == CachedPrefix(2, 0)
    assert index.batches == {"p-0": 2} and index.rebuilds == {"p-0": 0}


def test_a_rebuild_replaces_and_forget_empties() -> None:
    index = KVIndex(["d-0"])
    index.apply("d-0", [KVEvent("stored", "device", "full", [1, 2])])
    index.rebuild("d-0", {"full": {"device": [7], "host": [8]}})
    assert index.cached_prefix("d-0", [1]) == CachedPrefix()
    assert index.cached_prefix("d-0", [7, 8]) == CachedPrefix(1, 1)
    assert index.rebuilds == {"d-0": 1}
    index.forget("d-0")
    assert index.cached_prefix("d-0", [7, 8]) == CachedPrefix()


def test_a_model_without_a_full_group_walks_its_first_group() -> None:
    index = KVIndex(["p-0"])
    index.apply("p-0", [KVEvent("stored", "device", "swa_4", [1, 2])])
    assert index.cached_prefix("p-0", [1, 2]) == CachedPrefix(2, 0)


def test_an_unknown_medium_is_refused() -> None:
    index = KVIndex(["p-0"])
    with pytest.raises(ValueError, match="unknown KV event medium 'disk'"):
        index.apply("p-0", [KVEvent("stored", "disk", "full", [1])])  # type: ignore[arg-type]
