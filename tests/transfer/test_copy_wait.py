"""transfer/copy_wait.py: how an awaited copy wait shares its event loop."""

from __future__ import annotations

import asyncio

import pytest

from transfer import TransceiverConfig
from transfer.copy_wait import wait_copy


class EndsAfter:
    """A copy that reports done on its ``n``-th query."""

    def __init__(self, n: int) -> None:
        self.left = n

    def query(self) -> bool:
        self.left -= 1
        return self.left <= 0


async def _other_work_during(spin_s: float) -> list[str]:
    """Runs a wait next to another task of the loop; the order in which they finished."""
    order: list[str] = []

    async def other() -> None:
        order.append("other")

    async def waiter() -> None:
        # Far more polls than the other task needs to run if the wait yields between them.
        assert await wait_copy(EndsAfter(200), timeout=10.0, spin_s=spin_s)
        order.append("copy")

    await asyncio.gather(waiter(), other())
    return order


def test_a_spinning_wait_keeps_the_loop_until_the_copy_ends() -> None:
    assert asyncio.run(_other_work_during(spin_s=10.0)) == ["copy", "other"]


def test_without_spin_the_loop_runs_other_work_between_polls() -> None:
    assert asyncio.run(_other_work_during(spin_s=0.0)) == ["other", "copy"]


def test_a_wait_past_its_timeout_reports_it() -> None:
    async def main() -> bool:
        return await wait_copy(EndsAfter(10**9), timeout=0.05, spin_s=0.01)

    assert asyncio.run(main()) is False


def test_no_copy_needs_no_wait() -> None:
    assert asyncio.run(wait_copy(None, timeout=1.0, spin_s=1.0)) is True


def test_the_spin_is_bounded_below_the_copy_deadline() -> None:
    for bad in (-0.001, float("inf"), float("nan"), 10.0):
        with pytest.raises(ValueError, match="loop_spin_s"):
            TransceiverConfig(loop_spin_s=bad, chunk_deadline_s=10.0)
    assert TransceiverConfig(loop_spin_s=0.0).loop_spin_s == 0.0
