"""transfer/copy_wait.py: the awaited copy wait lets its event loop run meanwhile and keeps its
deadline."""

from __future__ import annotations

import asyncio

from transfer.copy_wait import wait_copy


class EndsAfter:
    """A copy that reports done on its ``n``-th query."""

    def __init__(self, n: int) -> None:
        self.left = n

    def query(self) -> bool:
        self.left -= 1
        return self.left <= 0


def test_the_loop_runs_other_work_between_polls() -> None:
    async def main() -> list[str]:
        order: list[str] = []

        async def waiter() -> None:
            assert await wait_copy(EndsAfter(200), timeout=10.0)
            order.append("copy")

        async def other() -> None:
            order.append("other")

        await asyncio.gather(waiter(), other())
        return order

    assert asyncio.run(main()) == ["other", "copy"]


def test_a_wait_past_its_timeout_reports_it() -> None:
    async def main() -> bool:
        return await wait_copy(EndsAfter(10**9), timeout=0.05)

    assert asyncio.run(main()) is False


def test_no_copy_needs_no_wait() -> None:
    assert asyncio.run(wait_copy(None, timeout=1.0)) is True
