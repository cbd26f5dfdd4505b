"""Sliding-window pool groups over the transfer: a ticket lists per group only the pages the group
holds (a window group: its window, from ``first_page``), D pulls per group only the pages it
needs (its last window, past its own prefix hit), the bytes of a window group are its window's
pages, not the prompt's, and peers whose windows differ refuse each other."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcache.manager import KVCacheManager
from kvcache.spec import NULL_PAGE, PoolGroupSpec
from tests.transfer.conftest import CPU_PATHS, MODEL, config, wait_until
from transfer import KVReceiver, KVSender

pytestmark = pytest.mark.timeout(60)

PAGE = 4  # tokens per page
WINDOW = 8


def hybrid_specs(window: int = WINDOW) -> list[PoolGroupSpec]:
    """A full-attention group (3 layers) and a window group (1 layer) of one page size, both of
    the default roles (key, value), as the engine makes them."""
    return [
        PoolGroupSpec("full", (0, 1, 2), 64, PAGE, 2, 8, torch.float32),
        PoolGroupSpec(
            "swa",
            (3,),
            64,
            PAGE,
            2,
            8,
            torch.float32,
            sliding_window=window,
        ),
    ]


class Side:
    def __init__(self, window: int = WINDOW, seed: int = 0) -> None:
        self.kv = KVCacheManager(hybrid_specs(window), "none", "cpu")
        self.released: list[str] = []
        gen = torch.Generator().manual_seed(seed)
        for buf in self.kv.buffers.values():
            buf.copy_(torch.randn(buf.shape, generator=gen))

    def release(self, rid: str) -> None:
        self.kv.free(rid)
        self.released.append(rid)

    def rows(self, group: str, pages: list[int]) -> torch.Tensor:
        return self.kv.buffers[group][pages].clone()


@pytest.mark.parametrize("path", CPU_PATHS)
def test_a_window_group_moves_only_the_window_d_needs(path: str) -> None:
    p, d = Side(seed=1), Side(seed=2)
    sender = KVSender(p.kv.buffers, hybrid_specs(), MODEL, config(path), p.release)
    receiver = KVReceiver(d.kv.buffers, hybrid_specs(), MODEL, config(path))
    try:
        n = 20  # 5 prompt pages
        # P ran its last prefill chunk from token 12: its window group still holds the pages
        # that chunk read, from page (12 - 8 + 1) // 4 = 1 on.
        assert p.kv.allocate_slots("r", n, num_computed_tokens=12)
        held = p.kv.page_ids("r")
        assert held["swa"][0] == NULL_PAGE and NULL_PAGE not in held["swa"][1:]
        ticket = sender.publish("r", held, n)
        assert ticket.first_page == {"full": 0, "swa": 1}
        assert ticket.page_ids == {"full": held["full"], "swa": held["swa"][1:]}
        # D, as a decode worker allocates: as if the prompt were computed, so its window group
        # holds pages (20 - 8 + 1) // 4 = 3 on (and one for the next token).
        assert d.kv.allocate_slots("r", n + 1, num_computed_tokens=n)
        mine = d.kv.page_ids("r")
        skips = {"full": 0, "swa": 3}
        dst = {g: mine[g][skips[g] : 5] for g in mine}
        assert len(dst["swa"]) == 2
        result = receiver.pull_blocking(ticket, dst, skips, n)
        assert result.ok, result.error
        full_bytes = d.kv.specs["full"].page_bytes
        swa_bytes = d.kv.specs["swa"].page_bytes
        assert result.bytes == 5 * full_bytes + 2 * swa_bytes  # the window's pages only
        assert result.stats.pages == {"full": 5, "swa": 2}
        assert torch.equal(d.rows("full", dst["full"]), p.rows("full", held["full"]))
        assert torch.equal(d.rows("swa", dst["swa"]), p.rows("swa", held["swa"][3:5]))
        wait_until(lambda: p.released == ["r"])
        # P counts the same pages (recorded just after the release).
        wait_until(lambda: "last_transfer" in sender.stats())
        assert sender.stats()["last_transfer"]["pages"] == {"full": 5, "swa": 2}
        d.kv.free("r")
    finally:
        receiver.close()
        sender.close()
    p.kv.check_integrity()
    d.kv.check_integrity()


def test_a_page_d_needs_that_p_let_go_fails_the_pull_clearly() -> None:
    p, d = Side(seed=1), Side(seed=2)
    sender = KVSender(p.kv.buffers, hybrid_specs(), MODEL, config("ucx"), p.release)
    receiver = KVReceiver(d.kv.buffers, hybrid_specs(), MODEL, config("ucx"))
    try:
        assert p.kv.allocate_slots("r", 20, num_computed_tokens=19)  # window from page 3
        ticket = sender.publish("r", p.kv.page_ids("r"), 20)
        assert ticket.first_page["swa"] == 3
        assert d.kv.allocate_slots("r", 21)  # D holds every page, and asks for them all
        dst = {g: ids[:5] for g, ids in d.kv.page_ids("r").items()}
        result = receiver.pull_blocking(ticket, dst, 0, 20)
        assert not result.ok
        assert "we need the request's pages from 0 on, the prefill worker holds them from 3 on" in (
            result.error
        )
        d.kv.free("r")
        wait_until(lambda: p.released == ["r"])  # D's notice freed P's pages
    finally:
        receiver.close()
        sender.close()


def test_a_null_page_after_a_held_one_is_not_published() -> None:
    p = Side()
    sender = KVSender(p.kv.buffers, hybrid_specs(), MODEL, config("ucx"), p.release)
    try:
        with pytest.raises(ValueError, match="only a window group's first pages may be the null"):
            sender.publish("r", {"full": [1, 2], "swa": [3, NULL_PAGE]}, 8)
    finally:
        sender.close()


@pytest.mark.parametrize("path", CPU_PATHS)
def test_peers_with_different_windows_refuse_each_other(path: str) -> None:
    p, d = Side(window=WINDOW), Side(window=2 * WINDOW)
    sender = KVSender(p.kv.buffers, hybrid_specs(WINDOW), MODEL, config(path), p.release)
    receiver = KVReceiver(d.kv.buffers, hybrid_specs(2 * WINDOW), MODEL, config(path))
    try:
        assert sender.page_table.compat_hash != receiver.page_table.compat_hash
        assert p.kv.allocate_slots("r", 8)
        ticket = sender.publish("r", p.kv.page_ids("r"), 8)
        assert d.kv.allocate_slots("r", 9)
        dst = {g: ids[:2] for g, ids in d.kv.page_ids("r").items()}
        result = receiver.pull_blocking(ticket, dst, 0, 8)
        assert not result.ok and "compatibility hash mismatch" in result.error
        # A ticket that hides the difference: the handshake refuses the peer all the same.
        forged = dataclasses.replace(ticket, compat_hash=receiver.page_table.compat_hash)
        result = receiver.pull_blocking(forged, dst, 0, 8)
        assert not result.ok and "compatibility hash mismatch" in result.error
        assert "sliding windows differ: 'swa': ours window 8, peer's window 16" in result.error
        # Each pull tries a link first, and P refuses both in the handshake.
        wait_until(lambda: sender.stats()["refused_peers"] == 2)
        d.kv.free("r")
        assert sender.cancel("r") and p.released == ["r"]
    finally:
        receiver.close()
        sender.close()
