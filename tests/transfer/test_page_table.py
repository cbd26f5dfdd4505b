"""Page tables: built from pool group specs, sent as plain data, and hashed for compatibility."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcache.spec import MapperKind, PoolGroupSpec
from tests.transfer.conftest import MODEL, specs
from transfer.page_table import PageTable


def test_descriptor_carries_layout_roles_heads_window_and_sizes() -> None:
    table = PageTable.from_specs(MODEL, specs(two_groups=True))
    full = table.pool("full")
    assert full.pool_role == ("key", "value") and full.mapper_kind == "HND"
    assert (full.layer_ids, full.tokens_per_page, full.num_kv_heads, full.head_dim) == (
        (0, 1, 2),
        4,
        2,
        8,
    )
    assert (full.head_start, full.window) == (0, 0)
    assert (
        full.page_bytes == 3 * 2 * 4 * 2 * 8 * 4
        and full.dtype == "float32"
        and full.num_pages == 256
    )
    assert table.pool("extra").pool_role == ("key_extra", "value_extra")
    spec = dataclasses.replace(specs()[0], sliding_window=128)
    assert PageTable.from_specs(MODEL, [spec]).pools[0].window == 128


def test_wire_round_trip() -> None:
    table = PageTable.from_specs(MODEL, specs(two_groups=True))
    assert PageTable.from_wire(table.to_wire()) == table


def _table(
    model: str = MODEL, layers: tuple[int, ...] = (0, 1, 2), window: int | None = None, **kw: object
) -> PageTable:
    spec = specs(**kw)[0]  # type: ignore[arg-type]
    spec = dataclasses.replace(spec, layer_ids=layers, sliding_window=window)
    return PageTable.from_specs(model, [spec])


@pytest.mark.parametrize(
    "change",
    [
        dict(model="other"),
        dict(dtype=torch.bfloat16),
        dict(head_dim=16),
        dict(page_size=8),
        dict(layers=(0, 1)),
        dict(window=64),
    ],
)
def test_compat_hash_changes_with_what_peers_must_share(change: dict) -> None:
    assert _table().compat_hash != _table(**change).compat_hash


def test_compat_hash_ignores_pool_sizes_and_head_ranges_but_not_names_or_mapper_kinds() -> None:
    a = PageTable.from_specs(MODEL, specs(num_pages=64))
    assert a.compat_hash == PageTable.from_specs(MODEL, specs(num_pages=999)).compat_hash
    spec = specs()[0]
    for name, kind in [("main", MapperKind.HND), (spec.name, MapperKind.NHD)]:
        other = dataclasses.replace(spec, name=name, mapper_kind=kind)
        assert a.compat_hash != PageTable.from_specs(MODEL, [other]).compat_hash
    # Ranks of head-sharded pools hold other head ranges of one model: they must be able to talk
    # (the mapper decides what moves between them).
    hnd = dataclasses.replace(spec, mapper_kind=MapperKind.HND)
    table = PageTable.from_specs(MODEL, [hnd])
    shard = dataclasses.replace(table.pools[0], head_start=1, num_kv_heads=1)
    assert PageTable(MODEL, (shard,)).compat_hash == table.compat_hash
    replicated = dataclasses.replace(table.pools[0], mapper_kind="REPLICATED", num_kv_heads=1)
    assert PageTable(MODEL, (replicated,)).compat_hash == table.compat_hash
    # Without head-major pages, another head count is another model shape.
    nhd = dataclasses.replace(spec, mapper_kind=MapperKind.NHD)
    nhd4 = dataclasses.replace(nhd, num_kv_heads=4)
    assert (
        PageTable.from_specs(MODEL, [nhd]).compat_hash
        != PageTable.from_specs(MODEL, [nhd4]).compat_hash
    )


def test_roles_are_sorted_however_a_descriptor_is_made() -> None:
    pool = PageTable.from_specs(MODEL, specs()).pools[0]
    shuffled = dataclasses.replace(pool, pool_role=("value", "key"))
    assert shuffled.pool_role == ("key", "value")
    wire = PageTable(MODEL, (shuffled,)).to_wire()
    assert PageTable.from_wire(wire).compat_hash == PageTable(MODEL, (shuffled,)).compat_hash


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("layer_ids", [0, "1"], "'layer_ids': expected a list of ints"),
        ("page_bytes", 0, "'page_bytes': out of range"),
        ("head_start", -1, "'head_start': out of range"),
        ("window", "big", "'window': expected int"),
    ],
)
def test_malformed_wire_table_names_the_field(field: str, value: object, reason: str) -> None:
    wire = PageTable.from_specs(MODEL, specs()).to_wire()
    wire["pools"][0][field] = value
    with pytest.raises(ValueError, match=reason):
        PageTable.from_wire(wire)
    del wire["pools"][0][field]
    with pytest.raises(ValueError, match="expected a map with keys"):
        PageTable.from_wire(wire)


def test_pool_group_spec_round_trip_keeps_roles() -> None:
    spec = PoolGroupSpec("g", (0,), 8, 4, 2, 8, torch.float16, pool_role=frozenset({"latent"}))
    assert PageTable.from_specs(MODEL, [spec]).pool("g").pool_role == ("latent",)
