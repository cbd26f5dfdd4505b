"""Page tables: built from pool group specs, sent as plain data, and hashed for compatibility."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcache.spec import MapperKind, PoolGroupSpec
from tests.transfer.conftest import MODEL, specs
from transfer.page_table import PageTable


def test_descriptor_carries_layout_roles_and_sizes() -> None:
    table = PageTable.from_specs(MODEL, specs(two_groups=True))
    full = table.pool("full")
    assert full.pool_role == ("key", "value") and full.mapper_kind == "NHD"
    assert (full.layer_ids, full.tokens_per_page, full.num_kv_heads, full.head_dim) == (
        (0, 1, 2),
        4,
        2,
        8,
    )
    assert (
        full.page_bytes == 3 * 2 * 4 * 2 * 8 * 4
        and full.dtype == "float32"
        and full.num_pages == 256
    )
    assert table.pool("extra").pool_role == ("key_extra", "value_extra")
    assert table.bytes_per_token == (3 + 1) * 2 * 2 * 8 * 4


def test_wire_round_trip() -> None:
    table = PageTable.from_specs(MODEL, specs(two_groups=True))
    assert PageTable.from_wire(table.to_wire()) == table


@pytest.mark.parametrize(
    "change",
    [
        dict(model="other"),
        dict(dtype=torch.bfloat16),
        dict(heads=4),
        dict(head_dim=16),
        dict(page_size=8),
        dict(layers=(0, 1)),
    ],
)
def test_compat_hash_changes_with_what_peers_must_share(change: dict) -> None:
    def table(model: str = MODEL, layers: tuple[int, ...] = (0, 1, 2), **kw: object) -> PageTable:
        spec = specs(**kw)[0]  # type: ignore[arg-type]
        spec = PoolGroupSpec(
            spec.name,
            layers,
            spec.num_pages,
            spec.page_size,
            spec.num_kv_heads,
            spec.head_dim,
            spec.dtype,
        )
        return PageTable.from_specs(model, [spec])

    assert table().compat_hash != table(**change).compat_hash


def test_compat_hash_ignores_pool_sizes_but_not_names_or_mapper_kinds() -> None:
    # Tickets and PullRequests name pools, and the mapper serves equal kinds only: peers that
    # differ there could never move a page, so the handshake refuses them.
    a = PageTable.from_specs(MODEL, specs(num_pages=64))
    assert a.compat_hash == PageTable.from_specs(MODEL, specs(num_pages=999)).compat_hash
    spec = specs()[0]
    for name, kind in [("main", MapperKind.NHD), (spec.name, MapperKind.HND)]:
        other = PoolGroupSpec(
            name,
            spec.layer_ids,
            64,
            spec.page_size,
            spec.num_kv_heads,
            spec.head_dim,
            spec.dtype,
            mapper_kind=kind,
        )
        assert a.compat_hash != PageTable.from_specs(MODEL, [other]).compat_hash


def test_roles_are_sorted_however_a_descriptor_is_made() -> None:
    pool = PageTable.from_specs(MODEL, specs()).pools[0]
    shuffled = dataclasses.replace(pool, pool_role=("value", "key"))
    assert shuffled.pool_role == ("key", "value")
    wire = PageTable(MODEL, (shuffled,)).to_wire()
    assert PageTable.from_wire(wire).compat_hash == PageTable(MODEL, (shuffled,)).compat_hash


def test_malformed_wire_table_names_the_field() -> None:
    wire = PageTable.from_specs(MODEL, specs()).to_wire()
    wire["pools"][0]["layer_ids"] = [0, "1"]
    with pytest.raises(ValueError, match="'layer_ids': expected a list of ints"):
        PageTable.from_wire(wire)
