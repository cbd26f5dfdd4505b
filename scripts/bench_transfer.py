"""Benchmark: one request's KV moved P -> D by the transceiver, next to raw ucxx send/recv of the same
bytes between the same two processes and, on GPUs, a torch peer copy GPU0 -> GPU1, all in one run.

    python scripts/bench_transfer.py                      # CPU, 1 MiB .. 256 MiB
    python scripts/bench_transfer.py --device cuda --max-mib 1024 --out results.json

The parent process is the decode side (KVReceiver; cuda:1 on GPUs), a spawned child the prefill side
(KVSender; cuda:0). "ours" is the wall time of one ``pull`` (pull request, chunks, TransferDone, ack);
"raw" is a request message plus one ucxx send of the same number of bytes, over endpoints made the
same way (worker address, peer error handling). Pages are one run (``contiguous``: chunks go
straight between the pools), a random permutation (``scattered``: on the CPU each chunk one UCX
message listing its pages, ``--no-host-iov`` to stage them as GPUs do: gathered into and scattered
from staging buffers), or one run on one side only (``p-run``, ``d-run``). "direct" is a second decode-side receiver over the same pool that
reads P's pages itself (CUDA IPC on GPUs, shared memory on the CPU, checked against P's lease
board: direct_read.py). Each figure is the median of --repeats runs after one warm-up; the variants
and the raw exchange run interleaved, one of each per repetition in an order that turns by one each
repetition, so a busy spell of a shared host hits them alike (the JSON keeps every time, in
``times_s``); each ratio is also taken repetition by repetition (``*_paired_vs_*``: the median
of the per-repetition ratios, with quartiles in ``*_paired_q_*``). The last run of each size is
checked: D's pages are overwritten first, then compared with P's by three sums per page, one
plain and two weighted by byte position (so bytes moved within a page count too). A failed variant
is reported as its ``_error``, left out of the ratios, and makes the script exit non-zero.

On GPUs the peer copy is timed two ways: back to back (``peer_copy``, GPUs and caller always busy)
and, inside the interleaved loop, right after the same pipe round trip to P that precedes each pull
(``peer_copy_gap``: idle GPUs and a caller that just woke up, as for the pulls; P sums a checked
pull's pages after it). ``--hot`` also times every variant's pulls back to back (``*_hot``, tickets
published first; the last one checked as above). Like-for-like ratios are a pull against
``peer_copy_gap`` and a hot pull against ``peer_copy``; every ratio is printed.
On the CPU the direct path is also set next to ``host_copy`` (the same bytes between two warm buffers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from transfer_baselines import (  # noqa: E402
    host_copy_times,
    peer_buffers,
    peer_copy_once,
    peer_copy_times,
    raw_once,
    send_stop,
    staging_copy_ms,
)
from transfer_bench_setup import (  # noqa: E402
    LAYOUTS,
    MIB,
    bench_spec,
    choose_pages,
    config,
    format_row,
    gil_load,
    median_gbps,
    overwrite,
    page_sums,
    paired_ratios,
    start_prefill,
    sums_of,
)

from kvcache.spec import PoolGroupSpec  # noqa: E402
from transfer import KVReceiver, TransceiverConfig  # noqa: E402
from transfer.config import PROGRESS_MODES, resolve_progress_mode  # noqa: E402


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda:1" if args.device == "cuda" else "cpu")
    if args.device == "cuda":
        # D's GPU is the current one, as in a decode worker (worker_common/engine_setup.py): a launch
        # for another device than the current one pays a context switch.
        torch.cuda.set_device(device)
    spec = bench_spec(args.max_mib * MIB)
    conn, child, child_address = start_prefill(args)
    buf = torch.zeros(spec.buffer_shape, dtype=spec.dtype, device=device)
    # The first transceiver of a process sets its UCX progress mode. With the direct path alone,
    # that is the direct receiver, as in a decode worker that reads directly (its progress thread
    # sleeps: a spinning one slows direct reads); the other receiver then serves raw ucxx only.
    direct_first = "ucx" not in args.paths
    direct = None
    if direct_first:
        direct = KVReceiver({"full": buf}, [spec], "bench", config(args))
    receiver = KVReceiver({"full": buf}, [spec], "bench", config(args, direct_copy=False))
    if "direct" in args.paths and direct is None:
        # Same pool, second receiver: it opens P's pools and reads them directly (cuda_ipc).
        direct = KVReceiver({"full": buf}, [spec], "bench", config(args))
    # --async: the direct reads also awaited on an event loop, as a decode worker's actor does.
    loop = asyncio.new_event_loop() if args.async_pulls else None
    runtime = receiver.runtime
    conn.send(runtime.worker_address)
    raw_ep = runtime.run(runtime.create_endpoint(child_address), timeout=30)
    raw_dst = torch.empty(args.max_mib * MIB, dtype=torch.uint8, device=device)
    gen = torch.Generator().manual_seed(0)
    sizes = [MIB << i for i in range(32) if args.min_mib * MIB <= MIB << i <= args.max_mib * MIB]
    diag = staging_copy_ms(
        buf,
        spec.page_bytes,
        choose_pages(receiver.chunk_bytes // spec.page_bytes, spec, "scattered", gen),
    )
    print(
        f"one staged chunk ({receiver.chunk_bytes / MIB:.0f} MiB, scattered pages) on {device}: "
        f"gather {diag['gather_ms']:.3f} ms, scatter {diag['scatter_ms']:.3f} ms",
        flush=True,
    )
    variants = [
        (name, rec, layout, on_loop)
        for name, rec, on_loop in (
            ("ours", receiver if "ucx" in args.paths else None, None),
            ("direct", direct, None),
            ("direct_async", direct if loop is not None else None, loop),
        )
        if rec is not None
        for layout in args.layouts
    ]
    stop_load = threading.Event()
    load = (
        threading.Thread(target=gil_load, args=(stop_load,), daemon=True) if args.gil_load else None
    )
    if load is not None:
        load.start()
    rows: list[dict[str, Any]] = []
    for size in sizes:
        n = size // spec.page_bytes
        row: dict[str, Any] = {"bytes": size}
        times: dict[str, list[float]] = {f"{name}_{layout}": [] for name, _, layout, _ in variants}
        times["raw_ucxx"] = []
        if args.device == "cuda":
            times["peer_copy_gap"] = []
            peer = peer_buffers(size)
        failed: dict[str, str] = {}
        # Interleaved: each repetition runs every variant and the raw exchange back to back, so a
        # busy spell of a shared host hits them alike (one warm-up repetition first); the order
        # turns by one each repetition, so none always runs first, or right after another's ack.
        cases = [*variants, None]  # (None: the raw exchange)
        for rep in range(args.repeats + 1):
            last = rep == args.repeats
            for case in cases[rep % len(cases) :] + cases[: rep % len(cases)]:
                if case is None:
                    if "raw_ucxx" not in failed:
                        try:
                            elapsed = raw_once(runtime, raw_ep, raw_dst, size)
                            if rep:
                                times["raw_ucxx"].append(elapsed)
                        except Exception as e:
                            failed["raw_ucxx"] = f"{type(e).__name__}: {e}"
                    continue
                name, rec, layout, on_loop = case
                key = f"{name}_{layout}"
                if key in failed:
                    continue
                try:
                    elapsed, result = one_pull(
                        conn, rec, buf, spec, n, layout, gen, f"{name}-{rep}", last, on_loop
                    )
                except Exception as e:  # keep the other figures of this run
                    failed[key] = f"{type(e).__name__}: {e}"
                    continue
                if rep:
                    times[key].append(elapsed)
                row[f"{key}_chunks"], row[f"{key}_path"] = result.stats.chunks, result.stats.path
            if args.device == "cuda":  # after a round trip to P, as each pull is
                conn.send(("ping",))
                conn.recv()
                elapsed = peer_copy_once(*peer)
                if rep:
                    times["peer_copy_gap"].append(elapsed)
        if args.hot:  # every ticket first, then the pulls back to back
            for name, rec, layout, on_loop in variants:
                key = f"{name}_{layout}"
                if key not in failed:
                    try:
                        times[f"{key}_hot"] = hot_pulls(
                            conn, rec, buf, spec, n, layout, gen, args.repeats, name, on_loop
                        )
                    except Exception as e:  # keep the other figures of this run
                        failed[f"{key}_hot"] = f"{type(e).__name__}: {e}"
                        times[f"{key}_hot"] = []  # (reported below as its _error)
        for key, ts in times.items():
            if key in failed:
                row[f"{key}_error"] = failed[key]
            else:
                row[f"{key}_gbps"] = median_gbps(size, ts)
        row["times_s"] = {key: ts for key, ts in times.items() if key not in failed}
        if args.device == "cuda":
            row["peer_copy_gbps"] = median_gbps(size, peer_copy_times(size, args.repeats))
        elif "direct" in args.paths:
            row["host_copy_gbps"] = median_gbps(size, host_copy_times(size, args.repeats))
        for key in [k for k in row if k.startswith(("ours_", "direct_")) and k.endswith("_gbps")]:
            for base in ("raw_ucxx", "peer_copy", "peer_copy_gap", "host_copy"):
                if f"{base}_gbps" in row:
                    row[key.replace("_gbps", f"_vs_{base}")] = row[key] / row[f"{base}_gbps"]
        for base in ("raw_ucxx", "peer_copy_gap"):
            paired_ratios(row, times, base)
        for key in [k for k in row if k.startswith("direct_async_") and k.endswith("_gbps")]:
            blocking = key.replace("direct_async_", "direct_")  # an awaited pull, same run
            if blocking in row:
                row[key.replace("_gbps", "_vs_blocking")] = row[key] / row[blocking]
        rows.append(row)
        print(format_row(row), flush=True)
    if load is not None:
        stop_load.set()
        load.join(10)
    runtime.run(send_stop(raw_ep), timeout=30)
    conn.send(("stop",))
    prefill_stats = conn.recv()
    child.join(60)
    raw_ep.abort()
    if direct is not None:
        direct.close()
    receiver.close()
    if loop is not None:
        loop.close()
    return {
        "device": args.device,
        "page_bytes": spec.page_bytes,
        "staging_tokens": args.staging_tokens,
        "piece_chunk_tokens": args.piece_chunk_tokens,
        "staging_buffers": args.staging_buffers,
        "prestage": args.prestage,
        "prefill_stats": prefill_stats,
        "progress_mode": resolve_progress_mode(
            args.progress_mode, args.device == "cuda", direct_first
        ),
        "repeats": args.repeats,
        "paths": args.paths,
        "hot": args.hot,
        "async": args.async_pulls,
        "gil_load": args.gil_load,
        "staging_copy": diag,
        "rows": rows,
    }


def one_pull(
    conn: Any,
    receiver: KVReceiver,
    buf: torch.Tensor,
    spec: PoolGroupSpec,
    n: int,
    layout: str,
    gen: torch.Generator,
    run_name: str,
    check: bool,
    loop: asyncio.AbstractEventLoop | None = None,
) -> tuple[float, Any]:
    """Wall time of one pull as the caller sees it (awaited on ``loop`` if given), and its result;
    with ``check``, D's pages are overwritten first (a pull that writes nothing must not pass on
    an earlier run's bytes) and compared after with the sent ones (page_sums on both sides)."""
    src = choose_pages(n, spec, layout, gen, "p")
    dst = choose_pages(n, spec, layout, gen, "d")
    conn.send(("publish", f"{receiver.instance_id}-{layout}-{n}-{run_name}", src))
    ticket = conn.recv()
    if check:
        overwrite(buf, spec, dst)
    elapsed, result = timed_pull(receiver, ticket, dst, loop)
    if check and page_sums(buf, spec, dst) != sums_of(conn, src):
        raise RuntimeError(f"{layout} {n} pages: the received bytes differ from the sent ones")
    return elapsed, result


def hot_pulls(
    conn: Any,
    receiver: KVReceiver,
    buf: torch.Tensor,
    spec: PoolGroupSpec,
    n: int,
    layout: str,
    gen: torch.Generator,
    repeats: int,
    name: str,
    loop: asyncio.AbstractEventLoop | None = None,
) -> list[float]:
    """Pulls back to back, as a busy decode worker's: P publishes every ticket first, so no pull
    waits on P's answer (the default runs wait for it before each pull). Like the peer copies of
    ``peer_copy_times``, which run back to back too. The last one is checked as ``one_pull`` does."""
    tickets, srcs = [], []
    for rep in range(repeats + 1):
        rid = f"{receiver.instance_id}-hot-{name}-{layout}-{n}-{rep}"
        srcs.append(choose_pages(n, spec, layout, gen, "p"))
        conn.send(("publish", rid, srcs[-1]))
        tickets.append(conn.recv())
    dsts = [choose_pages(n, spec, layout, gen, "d") for _ in tickets]
    overwrite(buf, spec, dsts[-1])  # (the last pull writes those pages last)
    times = [timed_pull(receiver, t, dst, loop)[0] for t, dst in zip(tickets, dsts)]
    if page_sums(buf, spec, dsts[-1]) != sums_of(conn, srcs[-1]):
        raise RuntimeError(f"{layout} {n} pages, back to back: the received bytes differ")
    return times[1:]


def timed_pull(
    receiver: KVReceiver,
    ticket: Any,
    dst: list[int],
    loop: asyncio.AbstractEventLoop | None = None,
) -> tuple[float, Any]:
    """Wall time of one pull of the whole ticket into ``dst`` (``pull`` awaited on ``loop``, else
    ``pull_blocking``), and its result (raises if it failed)."""
    pages, n = {"full": dst}, ticket.declared_prompt_len
    start = time.perf_counter()
    if loop is None:
        result = receiver.pull_blocking(ticket, pages, 0, n)
    else:
        result = loop.run_until_complete(receiver.pull(ticket, pages, 0, n))
    elapsed = time.perf_counter() - start
    if not result.ok:
        raise RuntimeError(f"transfer failed: {result.error}")
    return elapsed, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--min-mib", type=int, default=1)
    parser.add_argument("--max-mib", type=int, help="default 256 on CPU, 1024 on GPUs (doubling)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--staging-tokens", type=int, help="a chunk: 4096 (64 MiB) on CPU, 16384 GPU"
    )
    parser.add_argument(
        "--piece-chunk-tokens",
        type=int,
        default=TransceiverConfig.piece_chunk_tokens,
        help="CPU: a chunk where both sides list their pages (default: the library's, 256 MiB here)",
    )
    parser.add_argument("--progress-mode", choices=list(PROGRESS_MODES), default="auto")
    parser.add_argument("--proto-info", action="store_true", help="set UCX_PROTO_INFO=y")
    parser.add_argument("--staging-buffers", type=int, default=4)
    for flag, text in (
        ("prestage", "P gathers each request's first chunk at publish time (transfer/prestage.py)"),
        (
            "host-iov",
            "CPU: scattered pages go as UCX piece lists, not staged (transfer/ucp_iov.py)",
        ),
    ):
        parser.add_argument(
            f"--{flag}", action=argparse.BooleanOptionalAction, default=True, help=text
        )
    parser.add_argument(
        "--layouts", nargs="+", choices=LAYOUTS, default=["contiguous", "scattered"]
    )
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=["ucx", "direct"],
        default=None,
        help="data paths to time: ucx (staged chunks over UCX) and direct (D reads P's pages "
        "through CUDA IPC, or shared memory on the CPU); default both",
    )
    parser.add_argument(
        "--hot",
        action="store_true",
        help="also time each variant's pulls back to back (every ticket published first)",
    )
    parser.add_argument(
        "--async",
        dest="async_pulls",
        action="store_true",
        help="also await the direct reads on an event loop, as a decode worker does (direct_async)",
    )
    parser.add_argument(
        "--gil-load",
        action="store_true",
        help="run a thread that executes Python without pause meanwhile (a busy engine thread)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    if args.max_mib is None:
        args.max_mib = 256 if args.device == "cpu" else 1024
    if args.paths is None:
        args.paths = ["ucx", "direct"]
    if args.staging_tokens is None:
        args.staging_tokens = 4096 if args.device == "cpu" else 16384
    if args.repeats < 1 or args.staging_buffers < 1 or args.staging_tokens % 16:
        parser.error(
            "--repeats and --staging-buffers must be >= 1, --staging-tokens a multiple of 16"
        )
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    results = run(args)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))
    failed = [k for row in results["rows"] for k in row if k.endswith("_error")]
    if failed:
        sys.exit(f"failed: {failed}")


if __name__ == "__main__":
    main()
