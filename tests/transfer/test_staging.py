"""Staging copies: gather then scatter moves exactly the chunk's pages; buffers are bounded."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.transfer.conftest import specs
from transfer.mapper import Fragment
from transfer.plan import Chunk
from transfer.staging import StagingBuffers, gather_chunk, pool_region, pool_rows, scatter_chunk


def pools(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    group_specs = specs(num_pages=16, two_groups=True, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    buffers = {s.name: torch.randn(s.buffer_shape, generator=gen).to(s.dtype) for s in group_specs}
    return buffers, pool_rows(buffers, {s.name: s.page_bytes for s in group_specs})


@pytest.mark.parametrize("shift", [0, 3], ids=["words", "bytes"])
def test_gather_then_scatter_moves_exactly_the_chunk_pages(shift) -> None:
    """From a staging buffer at a word address, and at one that is not (then copied as bytes)."""
    src, src_rows = pools(1)
    dst, dst_rows = pools(2)
    before = {g: t.clone() for g, t in dst.items()}
    pb = src_rows["full"].shape[1]
    pe = src_rows["extra"].shape[1]
    chunk = Chunk(
        0,
        (
            Fragment("full", "full", 3 * pb, 10 * pb, 2 * pb),  # pages 3,4 -> 10,11
            Fragment("full", "full", 7 * pb, 1 * pb, pb),  # page 7 -> 1
            Fragment("extra", "extra", 5 * pe, 6 * pe, pe),  # page 5 -> 6
        ),
    )
    buf = torch.empty(chunk.nbytes + 17, dtype=torch.uint8)  # a staging buffer may be larger
    staged = buf[shift : shift + chunk.nbytes]
    gather_chunk(chunk, src_rows, staged)
    scatter_chunk(chunk, staged, dst_rows)
    assert torch.equal(dst["full"][[10, 11, 1]], src["full"][[3, 4, 7]])
    assert torch.equal(dst["extra"][6], src["extra"][5])
    untouched = [i for i in range(16) if i not in (10, 11, 1)]
    assert torch.equal(dst["full"][untouched], before["full"][untouched])
    assert torch.equal(
        dst["extra"][[i for i in range(16) if i != 6]],
        before["extra"][[i for i in range(16) if i != 6]],
    )


def test_pool_region_is_the_pool_memory_itself() -> None:
    buffers, rows = pools(3)
    pb = rows["full"].shape[1]
    region = pool_region(rows["full"], 4 * pb, 2 * pb)
    region.zero_()
    assert (
        torch.count_nonzero(buffers["full"][4:6]) == 0
        and torch.count_nonzero(buffers["full"][6]) > 0
    )


def test_non_contiguous_storage_is_refused() -> None:
    with pytest.raises(ValueError, match="must be contiguous"):
        pool_rows({"full": torch.zeros(4, 8).t()}, {"full": 16})


def test_staging_buffers_are_made_lazily_and_bounded() -> None:
    async def scenario() -> None:
        staging = StagingBuffers(torch.device("cpu"), 64, 2)
        a, b = staging.try_acquire(), staging.try_acquire()
        assert (
            a is not None
            and b is not None
            and staging.try_acquire() is None
            and staging.in_use == 2
        )
        waiter = asyncio.ensure_future(staging.acquire())
        await asyncio.sleep(0)
        assert not waiter.done()
        staging.release(a)
        assert await asyncio.wait_for(waiter, 5) is a
        staging.release(b)
        assert staging.in_use == 1

    asyncio.run(scenario())
