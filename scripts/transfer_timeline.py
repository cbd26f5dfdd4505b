"""The --timeline of scripts/bench_transfer.py: marks at each stage of a pull, on both processes.

time.perf_counter is CLOCK_MONOTONIC on Linux, one clock for every process of a host: P's marks
go on D's timeline as they are. The marks wrap the transceiver's own functions (nothing of it
changes); each costs about a microsecond.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


class Marks:
    """D's marks of the pull in progress (the bench runs one pull at a time): name -> time, and
    the CUDA events around each page-copy launch."""

    def __init__(self) -> None:
        self.current: dict[str, float] | None = None
        self.events: list[tuple[Any, Any]] = []
        self.by_request: dict[str, dict[str, float]] = {}  # every timed pull's marks

    def mark(self, name: str) -> None:
        if self.current is not None:
            self.current[name] = time.perf_counter()


def install_d_marks(cuda: bool) -> Marks:
    import duet_kernels
    from transfer.link import Link
    from transfer.messages import TransferAck
    from transfer.paths import direct
    from transfer.paths.cuda_ipc import CudaIpcPath
    from transfer.paths.host_shm import HostShmPath
    from transfer.pull import PullSession

    m = Marks()

    def after_async(cls: Any, attr: str, name: str) -> None:
        orig = getattr(cls, attr)

        async def wrapped(*a: Any, **k: Any) -> Any:
            out = await orig(*a, **k)
            m.mark(name)
            return out

        setattr(cls, attr, wrapped)

    def after(owner: Any, attr: str, name: str) -> None:
        orig = getattr(owner, attr)

        def wrapped(*a: Any, **k: Any) -> Any:
            out = orig(*a, **k)
            m.mark(name)
            return out

        setattr(owner, attr, wrapped)

    after_async(PullSession, "send", "D request sent (write returned)")
    after(PullSession, "map", "D pages mapped")
    after_async(PullSession, "next_event", "D grant read")
    after(direct, "segment_ids", "D ids queued" if cuda else "D ids ready")
    after_async(CudaIpcPath, "copy", "D copy done, loop resumed")
    after_async(HostShmPath, "copy", "D copy done")
    copy_pages = duet_kernels.copy_pages

    def timed_copy(src: torch.Tensor, *a: Any, **k: Any) -> Any:
        if not (cuda and m.current is not None):
            out = copy_pages(src, *a, **k)
            m.mark("D copy returned")
            return out
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = copy_pages(src, *a, **k)
        m.mark("D kernel launched")
        end.record()
        m.events.append((begin, end))
        return out

    duet_kernels.copy_pages = timed_copy
    if cuda:  # the path's wait for its done event, on the helper thread
        after(torch.cuda.Event, "synchronize", "D done event waited (helper thread)")
    post = Link.post

    def post_marked(self: Link, msg: Any, timeout: float) -> None:
        post(self, msg, timeout)
        pull = m.by_request.get(msg.request_id) if isinstance(msg, TransferAck) else None
        if pull is not None:  # (it may be written after the next pull began: by request id)
            pull["D final notice sent (write returned)"] = time.perf_counter()

    Link.post = post_marked  # type: ignore[method-assign]
    return m


def install_p_marks() -> dict[str, dict[str, float]]:
    """P's marks, per request id: request read, admitted, grant written, release read, served."""
    from transfer import sender as sender_mod
    from transfer.messages import PullRequest, TransferAck
    from transfer.serve import ServeSession

    marks: dict[str, dict[str, float]] = {}
    on_message = sender_mod.KVSender._on_message

    def on_message_marked(self: Any, link: Any, msg: Any) -> None:
        if isinstance(msg, PullRequest):
            marks.setdefault(msg.request_id, {})["P request read"] = time.perf_counter()
        elif isinstance(msg, TransferAck):
            marks.setdefault(msg.request_id, {})["P release read"] = time.perf_counter()
        on_message(self, link, msg)

    sender_mod.KVSender._on_message = on_message_marked  # type: ignore[method-assign]
    admit = sender_mod.admit

    def admit_marked(sender: Any, link: Any, req: Any) -> Any:
        out = admit(sender, link, req)
        marks.setdefault(req.request_id, {})["P admitted"] = time.perf_counter()
        return out

    sender_mod.admit = admit_marked
    send, run = ServeSession.send, ServeSession.run

    async def send_marked(self: ServeSession, msg: Any) -> None:
        await send(self, msg)
        marks.setdefault(self.request.request_id, {})["P grant written"] = time.perf_counter()

    async def run_marked(self: ServeSession) -> None:
        await run(self)
        marks.setdefault(self.request.request_id, {})["P lease released"] = time.perf_counter()

    ServeSession.send = send_marked  # type: ignore[method-assign]
    ServeSession.run = run_marked  # type: ignore[method-assign]
    return marks


def sm_clock_mhz(device: str) -> float:
    """The GPU's current SM clock (NVML, through torch), or 0 where NVML is missing: a GPU left
    idle lowers its clocks, and a timed operation that follows an idle spell pays for it."""
    try:
        return float(torch.cuda.clock_rate(device))
    except Exception:  # no pynvml, or NVML refuses
        return 0.0


def timeline_medians(pulls: list[dict[str, float]]) -> list[tuple[str, float, float]]:
    """(stage, median ms from the pull's start, median ms from the stage before it), in order
    of the medians; each pull's marks relative to its "D pull called"."""
    names = {k for p in pulls for k in p if k != "D pull called" and not k.startswith("gpu ")}
    rows = []
    for name in names:
        rel = [1e3 * (p[name] - p["D pull called"]) for p in pulls if name in p]
        rows.append((statistics.median(rel), name))
    rows.sort()
    out, prev = [], None
    for med, name in rows:
        # The step from the stage before, per pull (a median of differences, not a difference
        # of medians), where both were marked.
        if prev is None:
            steps = [1e3 * (p[name] - p["D pull called"]) for p in pulls if name in p]
        else:
            steps = [1e3 * (p[name] - p[prev]) for p in pulls if name in p and prev in p]
        out.append((name, med, statistics.median(steps) if steps else float("nan")))
        prev = name
    return out
