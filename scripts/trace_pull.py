"""Trace: where one UCX pull's time goes, both processes on one clock.

Runs the benchmark's prefill process (scripts/transfer_bench_setup.py) and a decode-side receiver
like scripts/bench_transfer.py on the CPU, with timestamps (time.perf_counter: CLOCK_MONOTONIC,
shared by the two processes) around the steps of a pull: the control messages, every UCX send and
receive (piece lists too), the staging copies as the loop awaits them and as the copy thread runs
them. Scattered pages (or contiguous ones), UCX path, P prestaging (transfer/prestage.py) unless
--no-prestage. Prints the pull's and
raw ucxx's median wall times, then the timeline of a few pulls in ms from the caller's start.
The wrappers are installed on the classes at run time; nothing in transfer/ changes.
Usage: python scripts/trace_pull.py [--size-mib 16] [--staging-tokens 512] [--pulls 12]
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from transfer_baselines import raw_once, send_stop  # noqa: E402
from transfer_bench_setup import (  # noqa: E402
    choose_pages,
    cpu_decode_side,
    prefill_main,
    probe_settings,
)

MIB = 1 << 20
MARKS: list[tuple[str, float]] = []


def mark(name: str) -> None:
    MARKS.append((name, time.perf_counter()))


def _around(obj: Any, name: str, label: Any, is_async: bool) -> None:
    """Wrap ``obj.name`` with marks "<label>>" before and "<label><" after."""
    orig = getattr(obj, name)

    def text(args: tuple) -> str:
        return label(*args) if callable(label) else label

    if is_async:

        @functools.wraps(orig)
        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            what = text(args)
            mark(what + ">")
            try:
                return await orig(*args, **kwargs)
            finally:
                mark(what + "<")
    else:

        @functools.wraps(orig)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            what = text(args)
            mark(what + ">")
            try:
                return orig(*args, **kwargs)
            finally:
                mark(what + "<")

    setattr(obj, name, wrapped)


def install() -> None:
    import transfer.admit
    import transfer.control
    import transfer.pull
    import transfer.receiver
    import transfer.sender
    import transfer.serve
    from transfer.peer import PeerLink
    from transfer.pull import PullSession
    from transfer.runtime import UcxRuntime
    from transfer.sender import KVSender
    from transfer.serve import ServeSession

    _around(PeerLink, "send", lambda _s, msg, *_: f"send {type(msg).__name__}", True)
    _around(PeerLink, "send_data", lambda _s, _b, tag: f"send chunk {tag & 0xFFFF}", True)
    _around(PeerLink, "recv_data", lambda _s, _b, tag: f"receive chunk {tag & 0xFFFF}", True)
    _around(
        PeerLink,
        "send_pieces",
        lambda _s, _i, p, tag: f"send chunk {tag & 0xFFFF} as {len(p)} pieces",
        True,
    )
    _around(
        PeerLink,
        "recv_pieces",
        lambda _s, _i, p, tag: f"receive chunk {tag & 0xFFFF} as {len(p)} pieces",
        True,
    )
    _around(KVSender, "_on_message", lambda _s, _l, msg: f"P handles {type(msg).__name__}", False)
    _around(PullSession, "deliver", lambda _s, msg: f"D gets {type(msg).__name__}", False)
    _around(ServeSession, "run", "serve session", True)
    _around(PullSession, "run", "pull session", True)
    _around(UcxRuntime, "copy", lambda _s, fn, *_: f"await {fn.__name__}", True)
    _around(transfer.pull, "scatter_chunk", "  copy thread: scatter", False)
    _around(transfer.serve, "gather_chunk", "  copy thread: gather", False)
    # The Python steps before the first byte moves: D's and P's plans, P's admission, the piece
    # lists, and each control message's encode (frame) and decode.
    _around(transfer.receiver.KVReceiver, "_submit", "D submit", False)
    _around(transfer.pull, "build_plan", "D build_plan", False)
    _around(transfer.admit, "build_plan", "P build_plan", False)
    _around(transfer.sender, "admit", "P admit", False)
    _around(transfer.pull, "chunk_pieces", "D chunk_pieces", False)
    _around(transfer.serve, "chunk_pieces", "P chunk_pieces", False)
    _around(transfer.control, "_frame", "frame", False)
    _around(transfer.control, "decode_message", "decode", False)


def prefill_traced(conn: Any, args: argparse.Namespace, out: str) -> None:
    install()
    prefill_main(conn, args)
    with open(out, "w") as f:
        json.dump(MARKS, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=16)
    parser.add_argument("--staging-tokens", type=int, default=512)
    parser.add_argument("--pulls", type=int, default=12)
    parser.add_argument("--layout", choices=["scattered", "contiguous"], default="scattered")
    parser.add_argument("--no-prestage", dest="prestage", action="store_false")
    parser.add_argument("--show", type=int, default=3, help="timelines printed (the last pulls)")
    args = parser.parse_args()
    settings = probe_settings("cpu", [args.size_mib])
    settings.staging_tokens = args.staging_tokens
    settings.prestage = args.prestage
    install()
    p_marks = os.path.join(tempfile.mkdtemp(prefix="duet-trace-"), "prefill.json")
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=prefill_traced, args=(child_conn, settings, p_marks), daemon=True)
    child.start()
    _port, child_address = conn.recv()
    spec, receiver, raw_ep, raw_dst = cpu_decode_side(settings, args.size_mib, conn, child_address)
    runtime = receiver.runtime
    gen = torch.Generator().manual_seed(0)
    n = args.size_mib * MIB // spec.page_bytes
    ours, raw, starts = [], [], []
    for i in range(args.pulls):
        src, dst = (choose_pages(n, spec, args.layout, gen) for _ in range(2))
        conn.send(("publish", f"trace-{i}", src))
        ticket = conn.recv()
        starts.append(len(MARKS))
        mark("caller starts the pull")
        start = time.perf_counter()
        result = receiver.pull_blocking(ticket, {"full": dst}, 0, ticket.declared_prompt_len)
        elapsed = time.perf_counter() - start
        mark("caller has the result")
        if not result.ok:
            raise RuntimeError(result.error)
        raw_s = raw_once(runtime, raw_ep, raw_dst, args.size_mib * MIB)
        if i >= 2:  # the first pulls warm up (and make P prestage: it saw a UCX pull)
            ours.append(elapsed)
            raw.append(raw_s)
    runtime.run(send_stop(raw_ep), timeout=30)
    conn.send(("stop",))
    conn.recv()
    child.join(60)
    receiver.close()
    with open(p_marks) as f:
        theirs = [("P", name, t) for name, t in json.load(f)]
    ours_ms, raw_ms = statistics.median(ours) * 1e3, statistics.median(raw) * 1e3
    print(
        f"{args.size_mib} MiB {args.layout}, {args.staging_tokens} tokens a chunk: pull {ours_ms:.2f} ms, "
        f"raw ucxx {raw_ms:.2f} ms (ratio {raw_ms / ours_ms:.2f}), medians of {len(ours)}"
    )
    for i in range(args.pulls - args.show, args.pulls):
        mine = MARKS[starts[i] :]
        t0 = mine[0][1]
        end = next(t for name, t in mine if name == "caller has the result")
        events = [("D", name, t) for name, t in mine if t <= end]
        events += [e for e in theirs if t0 <= e[2] <= end]
        print(f"--- pull {i}")
        for side, name, t in sorted(events, key=lambda e: e[2]):
            print(f"  {(t - t0) * 1e3:7.3f} {side} {name}")


if __name__ == "__main__":
    main()
