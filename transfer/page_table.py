"""PageTable: what one worker tells a peer about its KV pools, and the compatibility hash.

Peers exchange page tables once per connection, after authentication (handshake.py). The mapper
(mapper.py) reads both tables to turn page ids into page segments; the compatibility hash lets two
workers refuse each other before any byte moves when they serve different models or lay KV out
differently.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvcache.spec import PoolGroupSpec
from transfer.version import PAGE_LAYOUT, PROTOCOL_VERSION


@dataclass(frozen=True)
class PoolDescriptor:
    """One pool group as a peer sees it. ``pool_role`` is sorted; pools match across peers iff their
    roles are equal. ``page_bytes`` is one page (all layers, keys and values). ``head_start`` is the
    first KV head this worker holds (0 unless the pool is head-sharded across ranks: its heads are
    ``[head_start, head_start + num_kv_heads)``); ``window`` the sliding window in tokens (0: full
    attention), whose group holds only the window's pages."""

    name: str
    pool_role: tuple[str, ...]
    mapper_kind: str
    layer_ids: tuple[int, ...]
    tokens_per_page: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_bytes: int
    num_pages: int
    head_start: int = 0
    window: int = 0
    layout: str = PAGE_LAYOUT

    def __post_init__(self) -> None:
        object.__setattr__(self, "pool_role", tuple(sorted(self.pool_role)))

    @classmethod
    def from_spec(cls, spec: PoolGroupSpec) -> PoolDescriptor:
        return cls(
            name=spec.name,
            pool_role=tuple(sorted(spec.pool_role)),
            mapper_kind=str(spec.mapper_kind.value),
            layer_ids=tuple(spec.layer_ids),
            tokens_per_page=spec.page_size,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=dtype_name(spec.dtype),
            page_bytes=spec.page_bytes,
            num_pages=spec.num_pages,
            window=spec.sliding_window or 0,
            head_start=spec.head_start,
        )

    def geometry(self) -> tuple[Any, ...]:
        """Everything that decides where a byte of a page lives: two pools of equal geometry
        exchange whole pages byte for byte."""
        return (
            self.layout,
            self.layer_ids,
            self.tokens_per_page,
            self.head_start,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.page_bytes,
        )


@dataclass(frozen=True)
class PageTable:
    """A worker's pools, in the order of its pool groups."""

    model: str
    pools: tuple[PoolDescriptor, ...]

    def __post_init__(self) -> None:
        names = [p.name for p in self.pools]
        if not self.pools or len(set(names)) != len(names):
            raise ValueError(f"a page table needs pools with distinct names, got {names}")

    @classmethod
    def from_specs(cls, model: str, specs: Iterable[PoolGroupSpec]) -> PageTable:
        return cls(model=model, pools=tuple(PoolDescriptor.from_spec(s) for s in specs))

    def pool(self, name: str) -> PoolDescriptor:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(f"no pool group {name!r} here (have {[p.name for p in self.pools]})")

    @functools.cached_property
    def compat_hash(self) -> str:
        return compat_hash(self.model, self.pools)

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.model, self.pools))

    def __hash__(self) -> int:
        # Once per table (it is immutable): mapper.match_pools looks tables up on every pull.
        return self._hash

    def to_wire(self) -> dict[str, Any]:
        """Plain msgpack-able form (lists, ints, strings)."""
        return {
            "model": self.model,
            "pools": [
                {k: list(v) if isinstance(v, tuple) else v for k, v in p.__dict__.items()}
                for p in self.pools
            ],
        }

    @classmethod
    def from_wire(cls, data: Any) -> PageTable:
        """Inverse of ``to_wire``. Raises ValueError naming the first field of the wrong shape."""
        if not isinstance(data, Mapping) or set(data) != {"model", "pools"}:
            raise ValueError("page table: expected a map with keys 'model' and 'pools'")
        if not isinstance(data["model"], str) or not isinstance(data["pools"], list):
            raise ValueError("page table: 'model' must be a string and 'pools' a list")
        return cls(model=data["model"], pools=tuple(_pool_from_wire(p) for p in data["pools"]))


_POOL_FIELDS: dict[str, type] = {
    "name": str,
    "pool_role": list,
    "mapper_kind": str,
    "layer_ids": list,
    "tokens_per_page": int,
    "num_kv_heads": int,
    "head_dim": int,
    "dtype": str,
    "page_bytes": int,
    "num_pages": int,
    "head_start": int,
    "window": int,
    "layout": str,
}
_MAY_BE_ZERO = {"head_start", "window"}


def _pool_from_wire(data: Any) -> PoolDescriptor:
    if not isinstance(data, Mapping) or set(data) != set(_POOL_FIELDS):
        raise ValueError(f"page table pool: expected a map with keys {sorted(_POOL_FIELDS)}")
    for key, kind in _POOL_FIELDS.items():
        value = data[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(
                f"page table pool field {key!r}: expected {kind.__name__}, got {type(value).__name__}"
            )
        if kind is int and value < (0 if key in _MAY_BE_ZERO else 1):
            raise ValueError(f"page table pool field {key!r}: out of range, got {value}")
    if not all(isinstance(r, str) for r in data["pool_role"]):
        raise ValueError("page table pool field 'pool_role': expected a list of strings")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in data["layer_ids"]):
        raise ValueError("page table pool field 'layer_ids': expected a list of ints")
    fields = dict(data)
    fields["pool_role"] = tuple(sorted(data["pool_role"]))
    fields["layer_ids"] = tuple(data["layer_ids"])
    return PoolDescriptor(**fields)


_HEAD_MAJOR_KINDS = frozenset({"HND", "REPLICATED"})
_HEAD_MAJOR = "head-major"


def compat_hash(model: str, pools: Iterable[PoolDescriptor]) -> str:
    """Hash of what two peers must share to exchange KV: model, dtype, layers, heads, head dim,
    page size, layout, windows, protocol version, and each pool's name (tickets name pools) and
    mapper kind, 16 hex digits. Pool sizes and head ranges may differ (the mapper decides); so may
    HND and REPLICATED, both head-major (a worker of more ranks than KV heads replicates them)."""
    identity = {
        "protocol_version": PROTOCOL_VERSION,
        "model": model,
        "pools": sorted(
            [
                p.name,
                _HEAD_MAJOR if p.mapper_kind in _HEAD_MAJOR_KINDS else p.mapper_kind,
                list(p.pool_role),
                p.layout,
                list(p.layer_ids),
                p.tokens_per_page,
                p.head_dim,
                p.dtype,
                p.window,
            ]
            + ([] if p.mapper_kind in _HEAD_MAJOR_KINDS else [p.num_kv_heads])
            for p in pools
        ),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
