"""One benchmark run: a workload sent at one request rate, bounded by count and an overall deadline."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from cluster.bench.arrivals import arrival_offsets
from cluster.bench.client import StreamingClient
from cluster.bench.records import BenchRequest, RequestRecord


@dataclass(frozen=True)
class ArrivalSettings:
    """How requests arrive in one run. ``request_rate`` is requests/s (inf: all at once);
    ``max_concurrency`` caps requests in flight (None: no cap; a request due while the cap is
    reached waits, and its latencies count from when it is actually sent)."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ramp_up_s: float = 0.0
    seed: int = 0


@dataclass
class RunOutcome:
    """The records of one run in workload order, its wall time (its start to the last end, as
    vLLM's), and the deadline it ran under."""

    records: list[RequestRecord]
    duration_s: float
    deadline_hit: bool
    deadline_s: float


# Beyond the requests' own bounds: the client's start and the stream's close.
_DEADLINE_SLACK_S = 5.0


def default_deadline(
    requests: Sequence[BenchRequest],
    offsets: Sequence[float],
    max_concurrency: int | None,
    request_timeout_s: float,
) -> float:
    """A run deadline that cuts no request its own timeout would let finish: the last scheduled
    arrival, plus a request timeout for each request that may have to wait for another to end (a
    slot under --max-concurrency, a conversation's previous turn) before its own.

    A fixed default (once 600 s) failed long low-rate sweeps whose every request was on time."""
    depth = [0] * len(requests)  # requests before this one in its chain of `after`
    for i, request in enumerate(requests):
        if request.after is not None:
            depth[i] = depth[request.after] + 1
    chain = max(depth, default=0) + 1
    waves = -(-len(requests) // max_concurrency) if max_concurrency else 1
    return max(offsets, default=0.0) + chain * waves * request_timeout_s + _DEADLINE_SLACK_S


def _unfinished(
    index: int, request: BenchRequest, deadline_s: float, start: float
) -> RequestRecord:
    now = time.perf_counter()
    return RequestRecord(
        index=index,
        prompt_len=request.prompt_len,
        max_tokens=request.output_len,
        start=start,
        end=now,
        error=f"not finished within the run deadline of {deadline_s} s",
    )


async def run_requests(
    client: StreamingClient,
    requests: Sequence[BenchRequest],
    arrivals: ArrivalSettings,
    deadline_s: float | None,
    show_progress: bool = True,
    label: str = "",
) -> RunOutcome:
    """Send ``requests`` on the arrival schedule and wait for all, or until ``deadline_s`` passes
    (None: ``default_deadline`` with the client's request timeout).

    A request with ``after`` (a conversation's later turn) is sent once that request ended, and
    not before its own arrival time. Requests still unsent or in flight at the deadline are
    cancelled and recorded as failures.
    """
    for i, request in enumerate(requests):
        if request.after is not None and not 0 <= request.after < i:
            raise ValueError(f"request {i} follows request {request.after}: not an earlier one")
    if arrivals.max_concurrency is not None and arrivals.max_concurrency < 1:
        raise ValueError(f"max concurrency must be >= 1, got {arrivals.max_concurrency}")
    offsets = arrival_offsets(
        len(requests), arrivals.request_rate, arrivals.burstiness, arrivals.ramp_up_s, arrivals.seed
    )
    if deadline_s is None:
        deadline_s = default_deadline(
            requests, offsets, arrivals.max_concurrency, client.settings.request_timeout_s
        )
    limit = asyncio.Semaphore(arrivals.max_concurrency) if arrivals.max_concurrency else None
    progress = tqdm(
        total=len(requests),
        desc=label or None,
        file=sys.stderr,
        disable=not show_progress,
        leave=True,
    )
    start = time.perf_counter()
    ended = [asyncio.Event() for _ in requests]

    async def one(index: int, request: BenchRequest) -> RequestRecord:
        try:
            delay = start + offsets[index] - time.perf_counter()
            if delay > 0.0:
                await asyncio.sleep(delay)
            if request.after is not None:
                await ended[request.after].wait()
            if limit is None:
                record = await client.send(index, request)
            else:
                async with limit:
                    record = await client.send(index, request)
            progress.update(1)
            return record
        finally:
            ended[index].set()

    tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(requests)]
    pending: set[asyncio.Task[RequestRecord]] = set()
    try:
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        progress.close()
    # A cancelled task is one the deadline cut; any other exception is a bug and propagates.
    records = [
        _unfinished(i, requests[i], deadline_s, start) if task.cancelled() else task.result()
        for i, task in enumerate(tasks)
    ]
    # From the run's start, as `vllm bench serve` measures it (the first arrival gap included):
    # the same server gives the same throughput in both tools.
    duration = max((r.end for r in records), default=start) - start
    return RunOutcome(
        records=records, duration_s=duration, deadline_hit=bool(pending), deadline_s=deadline_s
    )
