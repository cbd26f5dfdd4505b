"""What a pool group is: the shapes, roles and layout that the cache, the kernels and the transceiver agree on.

Layout of one pool group's storage (one torch tensor, "page-major", heads outermost within a page):

    buffer: [num_pages, num_kv_heads, num_layers, 2, page_size, head_dim]
                                                  ^ 0 = key, 1 = value

Page-major means that everything of one page (all heads and layers of the group, keys and values) is
one contiguous run of ``page_bytes`` bytes, so moving a request's KV is a list of whole-page
fragments and contiguous page ids merge into one fragment. Heads outermost within the page (the
HND mapper kind) means that any run of consecutive heads of a page is one contiguous run too
(``head_bytes`` per head): a tensor-parallel rank holding heads [a, b) of a page moves its slice to
a rank of another tensor-parallel size as one fragment per page (transfer/mapper.py). Attention
kernels see one layer through a strided view ``buffer[:, :, layer, 0].transpose(1, 2)`` of shape
[num_pages, page_size, num_kv_heads, head_dim] (kv_buffer.layer_view); they index by strides, and
within one head a layer's tokens are contiguous rows of head_dim.

A tensor-parallel rank's pools hold its head shard (kvcache/head_shard.py): ``num_kv_heads`` of its
own, from ``head_start`` of the model's; replicated heads (more ranks than KV heads) are the
REPLICATED mapper kind, sharded or whole ones HND.

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


def group_window(name: str) -> int | None:
    """The attention window of the pool group ``name`` (``group_name``'s inverse)."""
    if name == FULL_GROUP:
        return None
    window = name.removeprefix("swa_")
    if window == name or not window.isdigit():
        raise ValueError(f"not a pool group name: {name!r}; expected 'full' or 'swa_<window>'")
    return int(window)


class MapperKind(str, enum.Enum):
    """How a pool's bytes may be re-split when peers shard the model differently."""

    HND = "HND"  # head-major contiguous runs: head-sharded peers can exchange head slices (ours)
    NHD = "NHD"  # token-major within a page: only whole pages can be exchanged
    REPLICATED = "REPLICATED"  # head-major, heads also held by other ranks: read from one of them
    SECTIONED = "SECTIONED"  # fixed sections per rank, copied section by section


KV_ROLES: frozenset[str] = frozenset({"key", "value"})


@dataclass(frozen=True)
class PoolGroupSpec:
    """One pool group: layers that share a page life cycle (full attention, or one window size).

    ``sliding_window`` is None for full attention; W means a query at position p attends to keys
    p - W + 1 .. p (W tokens, itself included: transformers' ``kv_idx > q_idx - W``). ``num_pages``
    counts the null page. ``num_kv_heads`` are the heads this pool holds, the model's
    ``[head_start, head_start + num_kv_heads)`` (all of them without tensor parallelism).
    """

    name: str
    layer_ids: tuple[int, ...]
    num_pages: int
    page_size: int  # tokens per page
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    pool_role: frozenset[str] = field(default=KV_ROLES)
    mapper_kind: MapperKind = MapperKind.HND
    sliding_window: int | None = None
    head_start: int = 0

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
        if self.head_start < 0 or self.num_kv_heads < 1:
            raise ValueError(
                f"pool group {self.name!r}: needs num_kv_heads >= 1 and head_start >= 0, got "
                f"{self.num_kv_heads} and {self.head_start}"
            )
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
            self.num_kv_heads,
            self.num_layers,
            2,
            self.page_size,
            self.head_dim,
        )

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head of one page: all layers of the group, keys and values (one run)."""
        return self.num_layers * 2 * self.page_size * self.head_dim * self.element_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all heads and layers of the group, keys and values."""
        return self.num_kv_heads * self.head_bytes

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1
