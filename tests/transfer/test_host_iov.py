"""Scattered host pages as one UCX message listing them (transfer/ucp_iov.py, ``host_iov``):
no staging copy on a side that lists its pages (P from the link's first chunk when the handshake
primed its endpoint, transfer/primer.py), piece chunks where both sides list, byte-exact."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tests.transfer.conftest import MODEL, KVSide, config, specs
from tests.transfer.test_runtime import in_fresh_process
from tests.transfer.test_transfer_local import wait_until
from transfer import KVReceiver, KVSender
from transfer.mapper import SMALL_RUNS, Fragment
from transfer.messages import Hello
from transfer.plan import Chunk
from transfer.primer import MAX_PRIMER_BYTES, wants_primer
from transfer.runtime import RENDEZVOUS_PROOF_BYTES, rendezvous_bytes
from transfer.ucp_abi import completion_callbacks
from transfer.ucp_iov import chunk_pieces

pytestmark = pytest.mark.timeout(120)
BIG_PAGES = dict(page_size=16, heads=4, head_dim=64)  # 96 KiB pages


def test_pieces_follow_wire_order_and_merge_neighbours_on_their_own_side() -> None:
    rows = {"a": torch.zeros(8, 16, dtype=torch.uint8), "b": torch.zeros(8, 16, dtype=torch.uint8)}
    chunk = Chunk(
        0,
        (
            Fragment("a", "b", 32, 0, 16),
            Fragment("a", "b", 48, 64, 16),  # P: follows the one before; D: does not
            Fragment("a", "b", 0, 80, 16),  # D: follows the one before; P: does not
        ),
    )
    a, b = rows["a"].data_ptr(), rows["b"].data_ptr()
    assert chunk_pieces(chunk, rows, source=True).tolist() == [[a + 32, 32], [a, 16]]
    assert chunk_pieces(chunk, rows, source=False).tolist() == [[b, 16], [b + 64, 32]]
    two_pools = Chunk(0, (Fragment("a", "b", 96, 0, 16), Fragment("b", "a", 0, 16, 16)))
    assert chunk_pieces(two_pools, rows, source=True).tolist() == [[a + 96, 16], [b, 16]]


@pytest.mark.parametrize("count", [SMALL_RUNS, SMALL_RUNS + 1, 300])
def test_long_and_short_chunks_list_the_same_pieces(count: int) -> None:
    # (long chunks take the numpy path; two pools, neighbours on one side only)
    rows = {
        "a": torch.zeros(1024, 16, dtype=torch.uint8),
        "b": torch.zeros(1024, 16, dtype=torch.uint8),
    }
    rng = random.Random(count)
    src = rng.sample(range(1024), count)
    frags = [
        Fragment("a" if i % 7 else "b", "b", s * 16, (i + (i // 5) % 2) * 16, 16)
        for i, s in enumerate(src)
    ]
    for source in (True, False):
        expected: list[list[int]] = []
        for f in frags:
            pool, offset = (f.src_pool, f.src_offset) if source else (f.dst_pool, f.dst_offset)
            address = rows[pool].data_ptr() + offset
            if expected and sum(expected[-1]) == address:
                expected[-1][1] += f.nbytes
            else:
                expected.append([address, f.nbytes])
        assert chunk_pieces(Chunk(0, tuple(frags)), rows, source).tolist() == expected


def test_rendezvous_size_follows_the_ucx_setting() -> None:
    assert rendezvous_bytes({}, {}) == RENDEZVOUS_PROOF_BYTES
    assert rendezvous_bytes({"UCX_RNDV_THRESH": "auto"}, {}) == RENDEZVOUS_PROOF_BYTES
    assert rendezvous_bytes({"UCX_RNDV_THRESH": "4m"}, {}) == (4 << 20) + 1
    assert rendezvous_bytes({}, {"UCX_RNDV_THRESH": "2M"}) == (2 << 20) + 1
    assert rendezvous_bytes({}, {"UCX_RNDV_THRESH": "1k"}) == RENDEZVOUS_PROOF_BYTES
    assert rendezvous_bytes({"UCX_RNDV_THRESH": "inf"}, {}) is None  # unreadable: never proven


def count_copies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the staging copies and piece-list messages of both sides, as they happen."""
    import transfer.peer
    import transfer.pull
    import transfer.serve

    calls: list[str] = []

    def counted(real, name: str):
        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(
        transfer.serve, "gather_chunk", counted(transfer.serve.gather_chunk, "gather")
    )
    monkeypatch.setattr(
        transfer.pull, "scatter_chunk", counted(transfer.pull.scatter_chunk, "scatter")
    )
    for name in ("send_pieces", "recv_pieces"):
        real = getattr(transfer.peer.PeerLink, name)
        monkeypatch.setattr(transfer.peer.PeerLink, name, counted(real, name))
    return calls


def scattered_sides(p_cfg, d_cfg) -> tuple[KVSide, KVSide, KVSender, KVReceiver]:
    p, d = KVSide(specs(**BIG_PAGES), seed=3), KVSide(specs(**BIG_PAGES), seed=4)
    p.scramble_free_queue()
    d.scramble_free_queue()
    sender = KVSender(p.kv.buffers, p.specs, MODEL, p_cfg, p.release)
    receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, d_cfg)
    return p, d, sender, receiver


def pull_exact(p, d, sender, receiver, rid: str, tokens: int = 1024):
    src, dst = p.allocate(rid, tokens), d.allocate(rid, tokens)
    result = receiver.pull_blocking(sender.publish(rid, src, tokens), dst, 0, tokens)
    assert result.ok, result.error
    assert torch.equal(d.pages_of(dst)["full"], p.pages_of(src)["full"])
    wait_until(lambda: rid in p.released)
    d.free(rid)
    return result


def only_link(sender: KVSender, receiver: KVReceiver):
    (d_link,) = receiver.links.open.values()
    (p_link,) = sender._links
    return p_link, d_link


def assert_no_piece_chunks(sender: KVSender, receiver: KVReceiver, primer_cancelled: bool) -> None:
    p_link, d_link = only_link(sender, receiver)
    assert p_link.info.piece_chunk_bytes == d_link.info.piece_chunk_bytes == 0
    if primer_cancelled:  # D posted the primer's receive, P did not send it: nothing stays out
        assert receiver.iov is not None
        wait_until(lambda: not receiver.iov._out)


def test_scattered_host_pages_move_without_staging_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sides' pages scattered, and both list them: the handshake's primer lets P list its
    pages from the link's first chunk (UCX cannot start an endpoint with an IOV send), so no
    chunk is staged on either side, from the first pull on. The bytes arrive exact."""
    calls = count_copies(monkeypatch)
    cfg = config(staging_tokens=64, staging_buffers=2, prestage=False)  # 4 pages: 384 KiB a chunk
    p, d, sender, receiver = scattered_sides(cfg, cfg)
    # (completions come by the C callbacks wherever they can be built)
    assert receiver.iov is not None
    assert receiver.iov.called_back == (completion_callbacks() is not None)
    try:
        for rid in ("first", "second"):
            calls.clear()
            result = pull_exact(p, d, sender, receiver, rid)
            assert result.stats.chunks == 16  # (piece chunks no larger than staging here)
            assert calls.count("send_pieces") == calls.count("recv_pieces") == 16, calls
            assert "gather" not in calls and "scatter" not in calls, calls
        p_link, d_link = only_link(sender, receiver)
        assert p_link.info.piece_chunk_bytes == d_link.info.piece_chunk_bytes == sender.chunk_bytes
    finally:
        receiver.close()
        sender.close()
    p.assert_clean()
    d.assert_clean()


@pytest.mark.parametrize("host_iov", [True, False])
def test_a_run_goes_through_our_ucp_messages(monkeypatch, host_iov: bool) -> None:
    """Pages that are one run on both sides (fresh pools; 64 pages, 6 MiB, one chunk) go through
    IovOps as plain bytes on both sides (their completions reach the loop sooner than ucxx's),
    and through ucxx where the sides make no UCP messages of their own (``host_iov`` off).
    Byte-exact either way."""
    import transfer.peer

    calls = count_copies(monkeypatch)
    for name in ("send_data", "recv_data"):
        real = getattr(transfer.peer.PeerLink, name)
        monkeypatch.setattr(
            transfer.peer.PeerLink, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a)
        )
    cfg = config(staging_tokens=64, staging_buffers=2, prestage=False, host_iov=host_iov)
    p, d = KVSide(specs(**BIG_PAGES), seed=3), KVSide(specs(**BIG_PAGES), seed=4)
    sender = KVSender(p.kv.buffers, p.specs, MODEL, cfg, p.release)
    receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, cfg)
    try:
        pull_exact(p, d, sender, receiver, "warm")  # (the link's handshake sends with ucxx)
        calls.clear()
        result = pull_exact(p, d, sender, receiver, "run")
        assert result.stats.chunks == 1
        own = ["recv_pieces", "send_pieces"] if host_iov else ["recv_data", "send_data"]
        assert sorted(calls) == own, calls
    finally:
        receiver.close()
        sender.close()
    p.assert_clean()
    d.assert_clean()


def test_where_both_sides_list_pages_chunks_are_piece_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``piece_chunk_tokens`` beyond ``staging_tokens``: each side offers its piece chunk size,
    the link takes the smaller, and a pull larger than a staging buffer goes in that many
    chunks, none of them staged. The pull request names that size, which P checks."""
    calls = count_copies(monkeypatch)
    p_cfg = config(staging_tokens=64, piece_chunk_tokens=512, prestage=False)
    d_cfg = config(staging_tokens=64, piece_chunk_tokens=256, prestage=False)
    p, d, sender, receiver = scattered_sides(p_cfg, d_cfg)
    assert sender.piece_chunk_bytes == 8 * sender.chunk_bytes
    assert receiver.piece_chunk_bytes == 4 * receiver.chunk_bytes
    try:
        result = pull_exact(p, d, sender, receiver, "big")
        assert result.stats.chunks == 4  # 1024 tokens in chunks of 256
        assert calls.count("send_pieces") == calls.count("recv_pieces") == 4, calls
        assert "gather" not in calls and "scatter" not in calls, calls
        p_link, d_link = only_link(sender, receiver)
        assert p_link.piece_sends_ok
        assert p_link.info.piece_chunk_bytes == d_link.info.piece_chunk_bytes
        assert d_link.info.piece_chunk_bytes == receiver.piece_chunk_bytes
        assert receiver.iov is not None and not receiver.iov._out  # the primer's receive ended
    finally:
        receiver.close()
        sender.close()
    p.assert_clean()
    d.assert_clean()


@pytest.mark.parametrize("lister", ["only P", "only D"])
def test_where_one_side_stages_chunks_fit_its_staging(
    monkeypatch: pytest.MonkeyPatch, lister: str
) -> None:
    """One side does not list host pages: no piece chunks on the link (the other side's staging
    buffers bound its chunks). With D staging, P sends no primer, so P stages until its endpoint
    has completed a rendezvous send of its own, then lists its pages; with P staging, D's primer
    receive is cancelled and nothing of it stays out."""
    calls = count_copies(monkeypatch)
    lists = config(staging_tokens=64, piece_chunk_tokens=512, prestage=False)
    stages = config(staging_tokens=64, host_iov=False, prestage=False)
    p_cfg, d_cfg = (lists, stages) if lister == "only P" else (stages, lists)
    p, d, sender, receiver = scattered_sides(p_cfg, d_cfg)
    try:
        for rid in ("first", "second"):
            calls.clear()
            result = pull_exact(p, d, sender, receiver, rid)
            assert result.stats.chunks == 16
            if lister == "only P":
                assert calls.count("scatter") == 16 and "recv_pieces" not in calls, calls
                gathers = calls.count("gather")
                assert gathers + calls.count("send_pieces") == 16
                if rid == "first":  # staged until the first staged send completed
                    assert 1 <= gathers < 16, calls
                else:
                    assert gathers == 0, calls
            else:
                assert calls.count("gather") == 16 and "send_pieces" not in calls, calls
                assert calls.count("recv_pieces") == 16 and "scatter" not in calls, calls
        assert_no_piece_chunks(sender, receiver, primer_cancelled=lister == "only D")
    finally:
        receiver.close()
        sender.close()
    p.assert_clean()
    d.assert_clean()


def test_a_primer_p_could_not_send_leaves_the_link_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    """P's primer failed (here: made to fail): its reply says so, D cancels its receive, the link
    takes no piece chunks, and P stages until its own rendezvous, as without a primer."""
    import transfer.peer

    async def failed(*_args, **_kwargs) -> bool:
        return False

    monkeypatch.setattr(transfer.peer, "send_primer", failed)
    calls = count_copies(monkeypatch)
    cfg = config(staging_tokens=64, piece_chunk_tokens=512, prestage=False)
    p, d, sender, receiver = scattered_sides(cfg, cfg)
    try:
        result = pull_exact(p, d, sender, receiver, "a")
        assert result.stats.chunks == 16 and 1 <= calls.count("gather") < 16, calls
        assert_no_piece_chunks(sender, receiver, primer_cancelled=True)
    finally:
        receiver.close()
        sender.close()
    p.assert_clean()
    d.assert_clean()


def test_p_admits_a_pull_only_at_the_agreed_chunk_size() -> None:
    """A pull cut at the staging size on a link that agreed piece chunks is refused with the
    reason, D gets its pages back at once and P when the lease expires, and the next pull at
    the agreed size succeeds."""
    cfg = config(staging_tokens=64, piece_chunk_tokens=512, prestage=False)
    p, d, sender, receiver = scattered_sides(dataclasses.replace(cfg, lease_s=1.0), cfg)
    try:
        pull_exact(p, d, sender, receiver, "warm")
        _, d_link = only_link(sender, receiver)
        agreed = d_link.info
        d_link.info = dataclasses.replace(agreed, piece_chunk_bytes=0)  # D plans staging chunks
        src, dst = p.allocate("r", 1024), d.allocate("r", 1024)
        result = receiver.pull_blocking(sender.publish("r", src, 1024), dst, 0, 1024)
        assert not result.ok and "differs from the agreed" in result.error, result.error
        wait_until(lambda: "r" in p.released)
        d.free("r")
        d_link.info = agreed
        assert pull_exact(p, d, sender, receiver, "next").stats.chunks == 2
    finally:
        receiver.close()
        sender.close()
    p.assert_clean()
    d.assert_clean()


def test_p_sends_the_primer_only_when_it_can_use_it() -> None:
    hello = Hello("d", None, b"", 1, "", 1 << 20, 7, 256 << 10)  # type: ignore[arg-type]
    assert wants_primer(hello, 1 << 20, 256 << 10)
    assert not wants_primer(hello, 0, 256 << 10)  # P does not list host pages
    assert not wants_primer(hello, 1 << 20, None)  # P's rendezvous threshold is unknown
    assert not wants_primer(hello, 1 << 20, (256 << 10) + 1)  # no rendezvous for P: useless
    no_pieces = dataclasses.replace(hello, piece_chunk_bytes=0)
    assert not wants_primer(no_pieces, 1 << 20, 256 << 10)
    huge = dataclasses.replace(hello, primer_bytes=MAX_PRIMER_BYTES + 1)
    assert not wants_primer(huge, 1 << 20, 256 << 10)  # a hostile Hello allocates nothing


def test_host_iov_off_stages_scattered_pages() -> None:
    p, d = KVSide(specs(), seed=5), KVSide(specs(), seed=6)
    p.scramble_free_queue()
    d.scramble_free_queue()
    cfg = config(host_iov=False)
    sender = KVSender(p.kv.buffers, p.specs, MODEL, cfg, p.release)
    receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, cfg)
    try:
        assert sender.iov is None and receiver.iov is None
        chunk = Chunk(
            0, (Fragment("full", "full", 0, 4096, 16), Fragment("full", "full", 64, 0, 16))
        )
        assert not receiver.moves_straight(chunk, source=False)
        assert not sender.moves_straight(chunk, source=True)
    finally:
        receiver.close()
        sender.close()


def test_without_c_callbacks_completions_are_polled(monkeypatch: pytest.MonkeyPatch) -> None:
    """No C compiler (here: DUET_UCP_CALLBACKS=0): the loop polls UCP for completions, the same
    scattered pull arrives byte-exact, and the loop gives the requests back soon after (UCX would
    warn at exit about any it did not, after the last line)."""
    monkeypatch.setenv("DUET_UCP_CALLBACKS", "0")
    in_fresh_process(
        """
import torch
from tests.transfer.conftest import MODEL, KVSide, config, specs
from transfer import KVReceiver, KVSender
p, d = KVSide(specs(page_size=16, heads=4, head_dim=64), seed=7), KVSide(specs(page_size=16, heads=4, head_dim=64), seed=8)
p.scramble_free_queue(); d.scramble_free_queue()
cfg = config(staging_tokens=64, prestage=False)
sender = KVSender(p.kv.buffers, p.specs, MODEL, cfg, p.release)
receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, cfg)
assert receiver.iov is not None and not receiver.iov.called_back
for rid in ("a", "b"):
    src, dst = p.allocate(rid, 512), d.allocate(rid, 512)
    result = receiver.pull_blocking(sender.publish(rid, src, 512), dst, 0, 512)
    assert result.ok, result.error
    assert torch.equal(d.pages_of(dst)["full"], p.pages_of(src)["full"])
import time, transfer.ucp_iov as u
time.sleep(u.FREE_LATER_S + 0.1)  # the loop gives finished requests back soon after their waiters
assert not receiver.iov._to_free and not sender.iov._to_free
receiver.close(); sender.close()
print("ok")
"""
    )
