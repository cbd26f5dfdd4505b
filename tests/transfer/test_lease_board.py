"""The lease board (transfer/lease_board.py): P publishes and retires slots, generations never
repeat (stale retires do nothing), a view in another process reads exactly what P wrote, a full
board says so, boards nobody holds are removed, and paths that are not boards are refused."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from transfer.lease_board import BoardUnavailable, LeaseBoard, LeaseBoardView, lease_digest

pytestmark = pytest.mark.timeout(60)


def _read_in_child(path: str, slot: int, conn) -> None:
    view = LeaseBoardView(path)
    conn.send(view.entry(slot))
    view.close()


def test_publish_retire_and_generations() -> None:
    board = LeaseBoard(2)
    view = LeaseBoardView(board.path)
    try:
        digest = lease_digest("r1", {"full": [3, 4], "extra": [9]})
        slot, gen = board.publish(17, digest)
        assert view.entry(slot) == ((gen << 1) | 1, 17, digest)
        other = board.publish(5, lease_digest("r2", {"full": [1]}))
        assert other is not None and other[0] != slot
        assert board.publish(1, digest) is None  # full: that lease goes over UCX
        board.retire(slot, gen)
        word, declared, got = view.entry(slot)
        assert not word & 1 and (declared, got) == (0, b"")
        board.retire(slot, gen)  # stale: nothing happens, the slot is not freed twice
        again = board.publish(17, digest)
        assert again is not None and again[0] == slot and again[1] > gen + 1  # no ABA
        board.retire(slot, gen)  # the old lease's retire cannot end the new one
        assert view.word(slot) == (again[1] << 1) | 1
        assert board.publish(1, digest) is None  # still full: the stale retire freed nothing
        assert view.word(-1) == 0 and view.word(2) == 0  # out of range reads as "not live"
    finally:
        view.close()
        board.close()
    assert not os.path.exists(board.path)


def test_digests_bind_request_and_exact_pages() -> None:
    base = lease_digest("r", {"full": [1, 2, 3]})
    assert lease_digest("r", {"full": [1, 2, 3]}) == base
    assert len(base) == 16
    for other in (
        lease_digest("r2", {"full": [1, 2, 3]}),
        lease_digest("r", {"full": [1, 3, 2]}),
        lease_digest("r", {"full": [1, 2]}),
        lease_digest("r", {"full": [1, 2, 3], "extra": []}),
    ):
        assert other != base


def test_a_view_in_another_process_reads_what_p_wrote() -> None:
    board = LeaseBoard(8)
    try:
        slot, gen = board.publish(1234, lease_digest("x", {"full": [7]}))
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_read_in_child, args=(board.path, slot, child))
        proc.start()
        assert parent.poll(30)
        assert parent.recv() == ((gen << 1) | 1, 1234, lease_digest("x", {"full": [7]}))
        proc.join(30)
    finally:
        board.close()


def test_generations_are_unique_across_slots_and_requests() -> None:
    board = LeaseBoard(2)
    try:
        seen = set()
        for i in range(20):
            slot, gen = board.publish(i, lease_digest("same-request", {"full": [1]}))
            assert gen not in seen
            seen.add(gen)
            board.retire(slot, gen)
    finally:
        board.close()
    board.retire(0, 1)  # after close: nothing, no error
    assert board.publish(1, b"x" * 16) is None


def test_boards_nobody_holds_are_removed_and_non_boards_refused(tmp_path) -> None:
    board = LeaseBoard(1)
    directory = os.path.dirname(board.path)
    stale = os.path.join(directory, "duet-leases-1-deadbeef0000")  # no owner holds its lock
    open(stale, "wb").close()
    second = LeaseBoard(1)  # making a board sweeps the stale one
    try:
        assert not os.path.exists(stale)
        assert os.path.exists(board.path)  # held by its owner (this process)
    finally:
        second.close()
        board.close()
    with pytest.raises(BoardUnavailable, match="not a lease board"):
        LeaseBoardView(str(tmp_path / "something-else"))
    fake = tmp_path / "duet-leases-1-x"
    fake.write_bytes(b"NOTABOARD" * 4)
    with pytest.raises(BoardUnavailable, match="not a lease board of this version"):
        LeaseBoardView(str(fake))
    with pytest.raises(BoardUnavailable, match="cannot open"):
        LeaseBoardView(str(tmp_path / "duet-leases-1-missing"))


def test_a_board_whose_pages_shared_memory_cannot_give_is_unavailable(monkeypatch) -> None:
    """tmpfs gives a file's pages on first write, and a full mount answers that write with a
    SIGBUS: so the board takes all its pages when made, and a full mount is an error then."""
    import errno
    import glob

    from transfer.shared_file import shared_dir

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def boards() -> set[str]:  # ours, and the scratch names (dot first) they are made under
        names = [f"duet-leases-{os.getpid()}-*", f".duet-leases-{os.getpid()}-*"]
        return {p for n in names for p in glob.glob(os.path.join(shared_dir(), n))}

    before = boards()
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(BoardUnavailable, match="No space left"):
        LeaseBoard(8)
    assert boards() <= before  # nothing left behind


def test_closing_the_board_retires_every_live_lease_for_its_readers() -> None:
    # A lease that ends after close (its retire then does nothing) gives its pages back all the
    # same: a reader that still maps the file must not see it live.
    board = LeaseBoard(2)
    view = LeaseBoardView(board.path)
    try:
        slot, gen = board.publish(3, lease_digest("r", {"full": [1]}))
        assert view.word(slot) == (gen << 1) | 1
        board.close()
        board.retire(slot, gen)  # the late retire: a no-op
        assert not view.word(slot) & 1
    finally:
        view.close()


def test_a_publish_that_fails_keeps_its_slot_free() -> None:
    board = LeaseBoard(1)
    try:
        with pytest.raises(OverflowError):
            board.publish(1 << 63, lease_digest("r", {"full": [1]}))  # no int64 prompt length
        assert board.publish(3, lease_digest("r", {"full": [1]})) is not None
    finally:
        board.close()
