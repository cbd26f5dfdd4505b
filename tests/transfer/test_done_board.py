"""DoneBoard (transfer/done_board.py): D's records of finished direct reads reach P's view in
order, each once; records overwritten before P read them are counted as lost, never returned torn
or twice; a board P cannot trust is refused; a post after close does nothing."""

from __future__ import annotations

import os

import pytest

from transfer.done_board import DoneBoard, DoneBoardUnavailable, DoneBoardView


def test_records_arrive_in_order_once() -> None:
    board = DoneBoard(capacity=8)
    view = DoneBoardView(board.path)
    try:
        assert view.drain() == ([], 0)
        board.post(3, 11, 4096, 17, "cuda_ipc")
        board.post(5, 12, 8192, 18, "host_shm")
        assert view.drain() == ([(3, 11, 4096, 17, "cuda_ipc"), (5, 12, 8192, 18, "host_shm")], 0)
        assert view.drain() == ([], 0)
        board.post(0, 13, 1, 1, "local")
        assert view.drain() == ([(0, 13, 1, 1, "local")], 0)
    finally:
        view.close()
        board.close()
    assert not os.path.exists(board.path)


def test_a_reader_that_falls_a_ring_behind_loses_the_oldest_records_only() -> None:
    board = DoneBoard(capacity=4)
    view = DoneBoardView(board.path)
    try:
        for gen in range(1, 11):  # ten records in a ring of four
            board.post(gen, gen, 0, 0, "local")
        records, lost = view.drain()  # record 7's place is the next one D writes: not trusted
        assert [r[1] for r in records] == [8, 9, 10] and lost == 7
        board.post(1, 99, 0, 0, "local")
        assert view.drain() == ([(1, 99, 0, 0, "local")], 0)
    finally:
        view.close()
        board.close()


def test_a_view_sees_only_what_was_posted_after_it_opened() -> None:
    board = DoneBoard(capacity=4)
    board.post(1, 1, 0, 0, "local")
    view = DoneBoardView(board.path)
    try:
        board.post(2, 2, 0, 0, "local")
        assert view.drain() == ([(2, 2, 0, 0, "local")], 0)
    finally:
        view.close()
        board.close()


def test_post_after_close_does_nothing_and_foreign_files_are_refused(tmp_path) -> None:
    board = DoneBoard(capacity=2)
    board.close()
    board.post(1, 1, 0, 0, "local")  # a read that ended after its link closed
    board.close()
    with pytest.raises(DoneBoardUnavailable, match="not a done board"):
        DoneBoardView(str(tmp_path / "elsewhere"))
    fake = tmp_path / "duet-done-fake"
    fake.write_bytes(b"DUETLB01" + bytes(56))  # another kind of board
    with pytest.raises(DoneBoardUnavailable, match="not a done board of this version"):
        DoneBoardView(str(fake))
    with pytest.raises(DoneBoardUnavailable, match="cannot open"):
        DoneBoardView(str(tmp_path / "duet-done-missing"))
    empty = tmp_path / "duet-done-empty"  # the right magic, but a ring of no records
    empty.write_bytes(b"DUETDB01" + bytes(24))
    with pytest.raises(DoneBoardUnavailable, match="not a done board of this version"):
        DoneBoardView(str(empty))
    with pytest.raises(ValueError):
        DoneBoard(capacity=0)


def test_a_record_being_overwritten_is_lost_not_returned() -> None:
    board = DoneBoard(capacity=4)
    view = DoneBoardView(board.path)
    try:
        for gen in range(1, 5):  # the ring is full: records 1..4
            board.post(gen, gen, 0, 0, "local")
        # D is writing record 5 into record 1's place and has not counted it yet while P reads.
        board._records[0] = (999, 7, 0, 0, 0)
        records, lost = view.drain()
        assert [r[1] for r in records] == [2, 3, 4] and lost == 1
    finally:
        view.close()
        board.close()


def test_a_view_learns_that_the_board_ended_after_its_last_record() -> None:
    board = DoneBoard(capacity=4)
    view = DoneBoardView(board.path)
    try:
        board.post(2, 5, 64, 7, "local")
        assert not view.ended
        board.close()  # D fell back to UCX, or left: P may stop polling after one last drain
        assert view.ended
        assert view.drain() == ([(2, 5, 64, 7, "local")], 0)
    finally:
        view.close()
