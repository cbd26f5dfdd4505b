"""next_item: a bounded queue wait that takes a waiting item at once, times out, and lets a cancel
through as a cancel."""

from __future__ import annotations

import asyncio

import pytest

from transfer.deadline import next_item


def test_an_item_already_there_is_taken_without_suspending() -> None:
    async def run() -> None:
        queue: asyncio.Queue[int] = asyncio.Queue()
        queue.put_nowait(7)
        other_ran = []
        asyncio.get_running_loop().call_soon(other_ran.append, True)
        assert await next_item(queue, 1.0) == 7
        assert not other_ran  # no loop step between the call and its result

    asyncio.run(run())


def test_a_wait_past_its_deadline_raises_timeout_and_leaves_later_items() -> None:
    async def run() -> None:
        queue: asyncio.Queue[int] = asyncio.Queue()
        with pytest.raises(asyncio.TimeoutError):
            await next_item(queue, 0.05)
        queue.put_nowait(3)
        assert await next_item(queue, 1.0) == 3

    asyncio.run(run())


def test_a_cancel_of_the_waiter_is_a_cancel_not_a_timeout() -> None:
    async def run() -> None:
        queue: asyncio.Queue[int] = asyncio.Queue()
        task = asyncio.ensure_future(next_item(queue, 5.0))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        queue.put_nowait(1)  # the cancelled wait took nothing
        assert await next_item(queue, 1.0) == 1

    asyncio.run(run())


def test_an_item_that_comes_in_time_is_returned() -> None:
    async def run() -> None:
        queue: asyncio.Queue[str] = asyncio.Queue()
        asyncio.get_running_loop().call_later(0.02, queue.put_nowait, "late")
        assert await next_item(queue, 2.0) == "late"

    asyncio.run(run())
