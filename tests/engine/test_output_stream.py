"""OutputStream: outputs pushed from the engine thread reach each request's queue in order, with
one wake-up of the consumer's loop per batch, and ``get`` waits only until its deadline."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.output_stream import OutputStream
from engine.outputs import RequestOutput
from engine.request import RequestMetrics


def output(rid: str, token: int) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        prompt=None,
        prompt_token_ids=[],
        text="",
        token_ids=[token],
        delta_text="",
        delta_token_ids=[token],
        finished=False,
        finish_reason=None,
        stop_reason=None,
        metrics=RequestMetrics(arrival_time=0.0),
    )


def test_a_step_of_outputs_wakes_the_loop_once_and_keeps_each_request_s_order() -> None:
    async def main() -> tuple[int, dict[str, list[int]]]:
        loop = asyncio.get_running_loop()
        wakes = 0
        real = loop.call_soon_threadsafe

        def counting(*args: object) -> object:
            nonlocal wakes
            wakes += 1
            return real(*args)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        streams = {rid: OutputStream(loop) for rid in ("a", "b", "c")}

        def engine_step() -> None:  # the engine thread hands one step's outputs over
            for token in range(4):
                for rid, stream in streams.items():
                    stream.push(output(rid, token))

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()
        got = {
            rid: [(await s.get(5.0)).token_ids[0] for _ in range(4)] for rid, s in streams.items()
        }
        return wakes, got

    wakes, got = asyncio.run(main())
    assert got == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [0, 1, 2, 3]}
    assert wakes == 1


def test_get_gives_up_at_its_deadline_and_then_still_receives() -> None:
    async def main() -> list[int]:
        stream = OutputStream(asyncio.get_running_loop())
        with pytest.raises(TimeoutError):
            await stream.get(0.05)
        threading.Thread(target=stream.push, args=(output("a", 7),)).start()
        return (await stream.get(5.0)).token_ids

    assert asyncio.run(main()) == [7]
