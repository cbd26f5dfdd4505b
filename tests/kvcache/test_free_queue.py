import pytest

from kvcache.free_queue import FreeQueue


def make(pages: list[int], capacity: int = 8) -> FreeQueue:
    q = FreeQueue(capacity)
    for p in pages:
        q.append(p)
    return q


def test_append_and_popleft_are_fifo() -> None:
    q = make([3, 1, 2])
    assert list(q) == [3, 1, 2]
    assert q.popleft() == 3
    assert q.popleft() == 1
    assert list(q) == [2]
    assert len(q) == 1
    q.check_integrity()


def test_remove_from_head_middle_and_tail() -> None:
    q = make([1, 2, 3, 4, 5])
    q.remove(3)
    q.remove(1)
    q.remove(5)
    assert list(q) == [2, 4]
    assert 3 not in q and 2 in q
    q.append(1)
    assert list(q) == [2, 4, 1]
    q.check_integrity()


def test_appendleft_goes_first() -> None:
    q = make([1, 2])
    q.appendleft(5)
    assert q.peek() == 5
    assert list(q) == [5, 1, 2]
    q.check_integrity()


def test_empty_queue() -> None:
    q = FreeQueue(4)
    assert len(q) == 0 and q.peek() is None and list(q) == []
    with pytest.raises(RuntimeError, match="empty"):
        q.popleft()
    q.append(0)
    assert q.popleft() == 0
    q.check_integrity()


def test_misuse_raises() -> None:
    q = make([1], capacity=3)
    with pytest.raises(RuntimeError, match="already in the free queue"):
        q.append(1)
    with pytest.raises(RuntimeError, match="already in the free queue"):
        q.appendleft(1)
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(2)
    with pytest.raises(ValueError, match="out of range"):
        q.append(3)
    q.check_integrity()


def test_integrity_detects_broken_links() -> None:
    q = make([1, 2, 3])
    q._next[1] = 3  # corrupt: skip page 2 going forward
    with pytest.raises(RuntimeError, match="free queue"):
        q.check_integrity()
