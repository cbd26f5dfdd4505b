"""What a pool group is: the shapes, roles and layout that the cache, the kernels and the transceiver agree on.

Layout of one pool group's storage (one torch tensor, "page-major"):

    buffer: [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]
                                    ^ 0 = key, 1 = value

Page-major means that everything of one page (all layers of the group, keys and values) is one
contiguous run of ``page_bytes`` bytes, so moving a request's KV is a list of whole-page fragments and
contiguous page ids merge into one fragment. Attention kernels see one layer through a strided view
``buffer[:, layer, 0]`` of shape [num_pages, page_size, num_kv_heads, head_dim] (token-major within a
page: the NHD mapper kind).

Page 0 of every pool is the reserved null page: never handed to a request, used as padding in page
tables so kernels never index out of bounds, and in a sliding-window group's page list for the
positions whose page was released (they left the window): page lists stay aligned with token
positions (entry i holds tokens i*page_size .. (i+1)*page_size - 1), so kernels index by position.

Group names: ``"full"`` for full attention, ``"swa_<window>"`` for a sliding window of that many
tokens (``group_name``); configs (``kvcache.pool_ratio``) and logs use them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

NULL_PAGE = 0
FULL_GROUP = "full"


def group_name(sliding_window: int | None) -> str:
    """The pool group of layers with this attention window (None: full attention)."""
    return FULL_GROUP if sliding_window is None else f"swa_{sliding_window}"


class MapperKind(str, enum.Enum):
    """How a pool's bytes may be re-split when peers shard the model differently."""

    HND = "HND"  # head-major contiguous runs: head-sharded peers can exchange head slices
    NHD = "NHD"  # token-major within a page (our attention layout)
    REPLICATED = "REPLICATED"  # identical on every rank: any one rank's copy will do
    SECTIONED = "SECTIONED"  # fixed sections per rank, copied section by section


KV_ROLES: frozenset[str] = frozenset({"key", "value"})


@dataclass(frozen=True)
class PoolGroupSpec:
    """One pool group: layers that share a page life cycle (full attention, or one window size).

    ``sliding_window`` is None for full attention; W means a query at position p attends to keys
    p - W + 1 .. p (W tokens, itself included: transformers' ``kv_idx > q_idx - W``). ``num_pages``
    counts the null page.
    """

    name: str
    layer_ids: tuple[int, ...]
    num_pages: int
    page_size: int  # tokens per page
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    pool_role: frozenset[str] = field(default=KV_ROLES)
    mapper_kind: MapperKind = MapperKind.NHD
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_pages < 2:
            raise ValueError(
                f"pool group {self.name!r}: num_pages must be >= 2 (page 0 is the null page), got {self.num_pages}"
            )
        if self.page_size < 1:
            raise ValueError(
                f"pool group {self.name!r}: page_size must be >= 1, got {self.page_size}"
            )
        if not self.layer_ids:
            raise ValueError(f"pool group {self.name!r}: layer_ids must not be empty")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"pool group {self.name!r}: sliding_window must be >= 1 or None, got {self.sliding_window}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        return (
            self.num_pages,
            self.num_layers,
            2,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers of the group, keys and values."""
        return (
            self.num_layers
            * 2
            * self.page_size
            * self.num_kv_heads
            * self.head_dim
            * self.element_size
        )

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1
