"""Benchmark: one request's KV moved P -> D by the transceiver, next to a baseline of the same bytes
measured in the same run.

    python scripts/bench_transfer.py                                  # CPU: ucx and host_shm
    python scripts/bench_transfer.py --device cuda --out transfer_gpu.json   # ucx and cuda_ipc
    python scripts/bench_transfer.py --device cuda --paths cuda_ipc --timeline  # where time goes

The parent process is the decode side (one KVReceiver per path), a spawned child the prefill side
(KVSender; on GPUs cuda:0, and D on cuda:1 when there is a second GPU, else cuda:0 too). D runs as
a decode worker does: its receivers on an event loop of its own (a worker actor's), which the
transfer runtime adopts, and each pull is awaited and timed there, from ``pull`` to its result.
Pages are scattered on both sides (random page ids).
Baselines, per path:

- ucx: raw ucxx between the same two processes: D posts a receive of the same number of bytes and
  sends an 8-byte request, P answers with one contiguous message (a round trip, as a pull's
  request is).
- host_shm: an in-process copy of the same pages, with the same copy function (duet_kernels.copy_pages)
  between two pools of D's process.
- cuda_ipc: a torch peer copy (``dst.copy_(src)``) of the same bytes from P's GPU to D's.

Every repetition runs each path and its baseline back to back, the order turning each time, so a
busy spell of a shared host hits both alike; a ratio (baseline time / path time) is taken per
repetition and reported as the median with quartiles, and so is the fixed cost (path time minus
baseline time, per repetition: at 1 MiB, where the bytes cost little, nearly all of it is what a
pull costs beyond its bytes). Each operation's CPU time is measured too, on both processes (all
their threads): less noisy than times on a busy host. The first pull of each size is
byte-checked against P's pages. The JSON keeps every time.

``--timeline`` also marks each stage of every timed pull on both processes (D: request written,
pages mapped, grant read, ids queued, kernel launched, done event waited, loop resumed, result,
final notice written; P: request read, admitted, grant written, notice read, lease released) and
prints each stage's median time from the pull's start; on GPUs the copy kernel's own GPU time, and
the copy alone (no pull) from P's pools through CUDA IPC, from D's own memory, with a wider
kernel tiling, and the baseline's copy. It wraps the transceiver's functions; figures for the
ratios are best taken without it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transfer_timeline import (  # noqa: E402  (this script's folder)
    install_d_marks,
    install_p_marks,
    sm_clock_mhz,
    timeline_medians,
)

from kvcache.kv_buffer import allocate_buffers  # noqa: E402
from kvcache.spec import PoolGroupSpec  # noqa: E402
from transfer import KVReceiver, KVSender, TransceiverConfig  # noqa: E402
from transfer.config import PROGRESS_MODES  # noqa: E402
from transfer.link import ucx_buffer  # noqa: E402
from transfer.mapper import Segment  # noqa: E402
from transfer.paths.direct import copy_segments  # noqa: E402
from transfer.pools import pool_rows  # noqa: E402
from transfer.runtime import UcxRuntime  # noqa: E402

MIB = 1 << 20
RAW_REQUEST, RAW_DATA, RAW_PAGE = 0x5EED_0001, 0x5EED_0002, 0x5EED_1000_0000
SECRET = "bench-secret"


def geometry(device: str) -> dict[str, Any]:
    """A page of the embedded SmolLM2 in float32 on the CPU (720 KiB), of the Llama-3-8B shape
    in bf16 on GPUs (2 MiB); 16 tokens each."""
    if device == "cpu":
        return dict(layers=30, heads=3, head_dim=64, dtype=torch.float32)
    return dict(layers=32, heads=8, head_dim=128, dtype=torch.bfloat16)


def spec(device: str, num_pages: int) -> PoolGroupSpec:
    g = geometry(device)
    layers = tuple(range(g["layers"]))
    return PoolGroupSpec("full", layers, num_pages, 16, g["heads"], g["head_dim"], g["dtype"])


def config(device: str, direct: bool, staging_tokens: int, progress_mode: str) -> TransceiverConfig:
    tls = "tcp,self" if device == "cpu" else "tcp,cuda_copy,cuda_ipc"
    return TransceiverConfig(
        secret=SECRET,
        staging_tokens=staging_tokens,
        direct_copy=direct,
        progress_mode=progress_mode,
        ucx_env={"UCX_TLS": tls, "UCX_NET_DEVICES": "lo"},
        pull_deadline_s=60.0,
        chunk_deadline_s=60.0,
        lease_s=120.0,
        connect_deadline_s=60.0,
    )


def _digest(rows: torch.Tensor, pages: list[int]) -> str:
    data = rows[torch.tensor(pages, device=rows.device)].cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def prefill_proc(
    conn: Connection,
    device: str,
    num_pages: int,
    staging_tokens: int,
    timeline: bool,
    progress_mode: str,
) -> None:
    """P: a KVSender over random pages, and the raw ucxx server of the baseline."""
    if device != "cpu":
        torch.cuda.set_device(device)
    s = spec("cpu" if device == "cpu" else "cuda", num_pages)
    buffers = allocate_buffers([s], torch.device(device))
    for b in buffers.values():
        b.view(torch.uint8).copy_(
            torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8, device=device)
        )
    rows = pool_rows(buffers, {"full": s.page_bytes})["full"]
    sender = KVSender(
        buffers,
        [s],
        "bench",
        config(device.split(":")[0], True, staging_tokens, progress_mode),
        lambda rid: None,
    )
    runtime = sender.runtime
    raw = torch.randint(0, 256, (num_pages * s.page_bytes,), dtype=torch.uint8, device=device)
    marks = install_p_marks() if timeline else {}
    conn.send((sender.port, runtime.worker_address))
    rng = np.random.default_rng(1)
    serving: Any = None
    while True:
        cmd, *args = conn.recv()
        if cmd == "publish":
            # (The digest only for a checked pull: a gather, a device-to-host copy and a hash of
            # every byte are seconds at 1 GiB, and device work of P's just before a timed pull.)
            rid, n, check = args
            pages = (rng.permutation(num_pages - 1)[:n] + 1).tolist()
            digest = _digest(rows, pages) if check else ""
            conn.send((sender.publish(rid, {"full": pages}, n * 16), digest))
        elif cmd == "marks":  # the timeline marks of one request's pull (--timeline)
            conn.send(marks.pop(args[0], {}))
        elif cmd == "cpu":  # this process's CPU seconds so far (every thread)
            conn.send(time.process_time())
        elif cmd == "raw":  # an endpoint to D's address for the raw baselines
            endpoint = runtime.run(runtime.create_endpoint(args[0]), 60)
            conn.send("connected")
        elif cmd == "arm":  # answer D's next raw request (see _serve_raw)
            serving = runtime.submit(_serve_raw(runtime, endpoint, raw, rows, num_pages))
            conn.send("armed")
        elif cmd == "close":
            if serving is not None and not serving.done():
                serving.cancel()
            sender.close()
            conn.send("closed")
            return


async def _serve_raw(
    runtime: UcxRuntime, ep: Any, buf: torch.Tensor, rows: torch.Tensor, num_pages: int
) -> None:
    """The raw ucxx answer to D's next request: [0, nbytes] gets one contiguous message of
    ``nbytes``; [1, n, page ids...] gets those n pages of P's pool, one message each, all posted
    at once (tag RAW_PAGE + i for the i-th). Its messages are progressed as the path's are
    (``runtime.messages``). One request per arming, armed over the pipe before each timed
    baseline: no receive stays posted between measurements."""
    request = np.zeros(2 + num_pages, dtype=np.int64)
    with runtime.messages():
        await ep.recv(request, tag=RAW_REQUEST, force_tag=True)
    kind, n = int(request[0]), int(request[1])
    with runtime.messages():
        if kind == 0:
            await ep.send(ucx_buffer(buf[:n]), tag=RAW_DATA, force_tag=True)
        else:
            pages = request[2 : 2 + n].tolist()
            await asyncio.gather(
                *(
                    ep.send(rows[p].numpy(), tag=RAW_PAGE + i, force_tag=True)
                    for i, p in enumerate(pages)
                )
            )


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        cuda = args.device == "cuda"
        page = spec(args.device, 2).page_bytes
        self.pages_for = {mib: max(1, round(mib * MIB / page)) for mib in args.sizes}
        self.num_pages = 2 * max(self.pages_for.values()) + 2
        p_dev = "cuda:0" if cuda else "cpu"
        d_dev = ("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0") if cuda else "cpu"
        self.p_dev, self.d_dev = p_dev, d_dev
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=prefill_proc,
            args=(
                child,
                p_dev,
                self.num_pages,
                args.staging_tokens,
                args.timeline,
                args.progress_mode,
            ),
            daemon=True,
        )
        self.proc.start()
        assert self.conn.poll(300), "the prefill process did not start"
        _, p_address = self.conn.recv()
        if cuda:
            torch.cuda.set_device(d_dev)
        self.spec = spec(args.device, self.num_pages)
        self.buffers = allocate_buffers([self.spec], torch.device(d_dev))
        self.rows = pool_rows(self.buffers, {"full": self.spec.page_bytes})["full"]
        # D's "worker loop": the receivers are made on it and the runtime runs there.
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.loop_thread.start()

        async def make() -> dict[str, KVReceiver]:
            loop = asyncio.get_running_loop()
            if cuda:  # D's GPU is its loop thread's current one, as in a decode worker
                torch.cuda.set_device(d_dev)
            return {
                path: KVReceiver(
                    self.buffers,
                    [self.spec],
                    "bench",
                    config(args.device, path != "ucx", args.staging_tokens, args.progress_mode),
                    loop=loop,
                )
                for path in args.paths
            }

        self.receivers = asyncio.run_coroutine_threadsafe(make(), self.loop).result(300)
        self.runtime = next(iter(self.receivers.values())).runtime
        self.rng = np.random.default_rng(2)
        self.count = 0
        self.marks = install_d_marks(cuda) if args.timeline else None
        self.timed_pulls: list[tuple[str, dict[str, float]]] = []  # (request id, D's marks)
        # Baselines: raw ucxx to P, a local pool for the in-process copy, peer buffers.
        self.ep = self.runtime.run(self.runtime.create_endpoint(p_address), 60)
        self.ask("raw", self.runtime.worker_address)
        # (Every page and buffer written once first: no run pays the first touch of memory.)
        self.rows.fill_(1)
        self.raw_buf = torch.ones(
            self.num_pages * self.spec.page_bytes, dtype=torch.uint8, device=d_dev
        )
        if "host_shm" in args.paths:
            local = allocate_buffers([self.spec], torch.device("cpu"))
            self.local_rows = pool_rows(local, {"full": self.spec.page_bytes})["full"]
            self.local_rows.copy_(torch.randint(0, 256, self.local_rows.shape, dtype=torch.uint8))
        if "cuda_ipc" in args.paths:
            self.peer_src = torch.randint(
                0, 256, self.raw_buf.shape, dtype=torch.uint8, device=p_dev
            )

    def ask(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        assert self.conn.poll(600), f"no answer to {cmd[0]}"
        return self.conn.recv()

    def publish(self, n: int, check: bool = False) -> tuple[Any, str]:
        """P publishes a fresh request of ``n`` random pages: (its ticket, the pages' digest, or
        "" unless ``check``)."""
        self.count += 1
        return self.ask("publish", f"r{self.count}", n, check)

    def pull(self, path: str, published: tuple[Any, str], check: bool) -> float:
        """Pull a published request into random pages of D, awaited on D's worker loop."""
        (ticket, digest), n = published, len(published[0].page_ids["full"])
        dst = (self.rng.permutation(self.num_pages - 1)[:n] + 1).tolist()

        marks = self.marks
        if marks is not None:  # its marks, the final notice's included, go in until the next pull
            marks.current, marks.events = {}, []
            marks.by_request[ticket.request_id] = marks.current
            self.timed_pulls.append((ticket.request_id, marks.current))

        async def timed() -> tuple[Any, float]:
            start = time.perf_counter()
            if marks is not None and marks.current is not None:
                marks.current["D pull called"] = start
            result = await self.receivers[path].pull(ticket, {"full": dst}, 0, n * 16)
            end = time.perf_counter()
            if marks is not None:
                marks.mark("D result")
            return result, end - start

        result, took = self.runtime.run(timed(), 600)
        if marks is not None and marks.current is not None and marks.events:
            torch.cuda.synchronize(self.d_dev)  # (not an event's wait: that is a marked stage)
            marks.current["gpu kernel ms"] = sum(b.elapsed_time(e) for b, e in marks.events)
        if not result.ok:
            raise RuntimeError(f"{path} pull of {n} pages failed: {result.error}")
        if check and _digest(self.rows, dst) != digest:
            raise RuntimeError(f"{path} pull of {n} pages: the bytes differ from P's")
        return took

    def baseline(self, path: str, n: int) -> float:
        if self.marks is None:
            return self._baseline(path, n)
        marks, self.marks.current = self.marks.current, None  # not a pull's stage
        try:
            return self._baseline(path, n)
        finally:
            self.marks.current = marks

    def _baseline(self, path: str, n: int) -> float:
        nbytes = n * self.spec.page_bytes
        if path == "ucx":
            self.ask("arm")
            return self.runtime.run(self._raw(nbytes), 600)
        if path == "host_shm":
            src = self.rng.permutation(self.num_pages - 1)[:n] + 1
            dst = self.rng.permutation(self.num_pages - 1)[:n] + 1
            seg = [Segment("full", "full", src, dst, self.spec.page_bytes)]
            start = time.perf_counter()
            copy_segments(seg, {"full": self.local_rows}, {"full": self.rows}, torch.device("cpu"))
            return time.perf_counter() - start
        torch.cuda.synchronize(self.d_dev)
        start = time.perf_counter()
        self.raw_buf[:nbytes].copy_(self.peer_src[:nbytes])
        torch.cuda.synchronize(self.d_dev)
        return time.perf_counter() - start

    async def _raw(self, nbytes: int) -> float:
        dst = ucx_buffer(self.raw_buf[:nbytes])
        start = time.perf_counter()
        with self.runtime.messages():  # (progressed as the path's messages are)
            recv = asyncio.ensure_future(self.ep.recv(dst, tag=RAW_DATA, force_tag=True))
            await self.ep.send(self._raw_request(0, nbytes), tag=RAW_REQUEST, force_tag=True)
            await recv
        return time.perf_counter() - start

    def _raw_request(self, kind: int, n: int, pages: list[int] | None = None) -> np.ndarray:
        request = np.zeros(2 + self.num_pages, dtype=np.int64)
        request[:2] = kind, n
        if pages:
            request[2 : 2 + len(pages)] = pages
        return request

    def raw_pages(self, n: int) -> float:
        """The bound on any UCX path over ucxx's public API for scattered host pages (no I/O
        vectors there): n random pages of P's pool into n random pages of D's, one raw message
        each, every receive and every send posted at once, no protocol of ours."""
        src = (self.rng.permutation(self.num_pages - 1)[:n] + 1).tolist()
        dst = (self.rng.permutation(self.num_pages - 1)[:n] + 1).tolist()
        self.ask("arm")

        async def go() -> float:
            start = time.perf_counter()
            with self.runtime.messages():
                receives = [
                    asyncio.ensure_future(
                        self.ep.recv(self.rows[d].numpy(), tag=RAW_PAGE + i, force_tag=True)
                    )
                    for i, d in enumerate(dst)
                ]
                await self.ep.send(self._raw_request(1, n, src), tag=RAW_REQUEST, force_tag=True)
                await asyncio.gather(*receives)
            return time.perf_counter() - start

        return self.runtime.run(go(), 600)

    def run(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sizes": {}}
        for mib in self.args.sizes:
            n = self.pages_for[mib]
            row: dict[str, Any] = {"pages": n, "bytes": n * self.spec.page_bytes}
            for path in self.args.paths:
                self.pull(path, self.publish(n, check=True), check=True)  # warm-up, byte check
                self.baseline(path, n)
                # ucx on host pages: also raw ucxx one message per page (raw_pages), the bound
                # of any path over ucxx's public API.
                ops = ["ours", "base"] + (["pages"] if self._pages_bound(path) else [])
                times: dict[str, list[float]] = {k: [] for k in ops}
                cpu: dict[str, list[float]] = {k: [] for k in ops}  # D + P, per operation
                self.timed_pulls = []
                clocks: dict[str, list[float]] = {"ours": [], "base": []}  # --timeline, GPU
                if "pages" in ops:
                    self.raw_pages(n)  # (its warm-up)
                for rep in range(self.args.repeats):
                    turn = rep % len(ops)  # the order turns each repetition
                    for which in ops[turn:] + ops[:turn]:
                        ticket = self.publish(n) if which == "ours" else None
                        if (
                            self.marks is not None
                            and self.args.device == "cuda"
                            and which != "pages"
                        ):
                            clocks[which].append(sm_clock_mhz(self.d_dev))
                        p_cpu, d_cpu = self.ask("cpu"), time.process_time()
                        if ticket is not None:
                            times[which].append(self.pull(path, ticket, check=False))
                        elif which == "base":
                            times[which].append(self.baseline(path, n))
                        else:
                            times[which].append(self.raw_pages(n))
                        d_cpu = time.process_time() - d_cpu
                        cpu[which].append(d_cpu + self.ask("cpu") - p_cpu)
                ours, base = times["ours"], times["base"]
                ratios = sorted(b / o for o, b in zip(ours, base, strict=True))
                fixed = sorted(o - b for o, b in zip(ours, base, strict=True))
                row[path] = {
                    "ms": 1e3 * statistics.median(ours),
                    "baseline_ms": 1e3 * statistics.median(base),
                    "gbps": row["bytes"] / statistics.median(ours) / 1e9,
                    "baseline_gbps": row["bytes"] / statistics.median(base) / 1e9,
                    **_median_quartiles("ratio", ratios),
                    **_median_quartiles("fixed_ms", [1e3 * f for f in fixed]),
                    "cpu_ms": 1e3 * statistics.median(cpu["ours"]),
                    "baseline_cpu_ms": 1e3 * statistics.median(cpu["base"]),
                    "times_s": ours,
                    "baseline_times_s": base,
                    "cpu_s": cpu["ours"],
                    "baseline_cpu_s": cpu["base"],
                }
                if "pages" in ops:
                    pages = times["pages"]
                    row[path] |= {
                        "pages_ms": 1e3 * statistics.median(pages),
                        "pages_cpu_ms": 1e3 * statistics.median(cpu["pages"]),
                        "pages_times_s": pages,
                        "pages_cpu_s": cpu["pages"],
                        # ours against the bound, and the bound against one contiguous message
                        **_median_quartiles(
                            "ratio_to_pages", sorted(p / o for o, p in zip(ours, pages))
                        ),
                        **_median_quartiles(
                            "pages_ratio", sorted(b / p for p, b in zip(pages, base))
                        ),
                    }
                if self.marks is not None:
                    row[path]["timeline"] = self.timeline(path, n)
                    known = {k: [c for c in v if c > 0] for k, v in clocks.items()}
                    if all(known.values()):
                        row[path]["timeline"]["sm_clock_mhz"] = clocks
                        print(
                            "    GPU clock just before each (NVML, median MHz): pull "
                            f"{statistics.median(known['ours']):.0f}, baseline "
                            f"{statistics.median(known['base']):.0f}"
                        )
            out["sizes"][str(mib)] = row
            self.report(mib, row)
        return out

    def _pages_bound(self, path: str) -> bool:
        return path == "ucx" and self.args.device == "cpu"

    def timeline(self, path: str, n: int) -> dict[str, Any]:
        """The stages of this size's timed pulls (medians), printed; with the kernel alone
        against the same copy from D's own memory and the baseline, on a GPU."""
        assert self.marks is not None
        self.marks.current = None
        time.sleep(0.05)  # the last pull's final notice, written after its result, reaches P
        pulls = []
        for rid, d_marks in self.timed_pulls:
            pulls.append({**d_marks, **self.ask("marks", rid)})
        stages = timeline_medians(pulls)
        mib = n * self.spec.page_bytes / MIB
        print(
            f"  timeline {path} {n} pages, {mib:.1f} MiB ({len(pulls)} pulls; median ms from the "
            "pull's start, and median step from the line before)"
        )
        for name, at, step in stages:
            print(f"    {at:8.3f}  +{step:7.3f}  {name}")
        out: dict[str, Any] = {"stages": [list(s) for s in stages], "pulls": pulls}
        gpu = [p["gpu kernel ms"] for p in pulls if "gpu kernel ms" in p]
        if gpu:
            out["gpu_kernel_ms"] = statistics.median(gpu)
            print(
                f"    GPU time of the pull's copy kernel (CUDA events around its launch): "
                f"{out['gpu_kernel_ms']:.3f} ms"
            )
        if path == "cuda_ipc":
            out["kernel_alone"] = self.kernel_alone(n)
        return out

    def kernel_alone(self, n: int) -> dict[str, float]:
        """GPU times (CUDA events on D's stream) of the pull's copy without the pull, same page
        counts, fresh random pages each time, interleaved with the order turning: the path's
        copy (``copy_segments``: ids upload and kernel) from P's pools as the link opened them
        (CUDA IPC) and from memory D allocated itself on the same GPU; the kernel with 64 KiB
        per program and 8 warps (path's: 16 KiB, 4) from each; the baseline's torch copy. Also
        the host time of the path's launch call (ids upload and Triton's dispatch)."""
        from duet_kernels.page_copy_triton import copy_pages as triton_copy
        from transfer.pools import as_words, segment_ids

        link = next(iter(self.receivers["cuda_ipc"].links.values()))
        page, nbytes, dev = self.spec.page_bytes, n * self.spec.page_bytes, torch.device(self.d_dev)
        sources = {"ipc": link.path.peer_rows["full"], "own": self.peer_src.view(-1, page)}

        def path_copy(src_rows: torch.Tensor, seg: list[Segment]) -> None:
            copy_segments(seg, {"full": src_rows}, {"full": self.rows}, dev)

        def wide_copy(src_rows: torch.Tensor, seg: list[Segment]) -> None:
            src_ids, dst_ids = segment_ids(seg[0], dev)
            src, dst = as_words(src_rows, self.rows)
            triton_copy(src, src_ids, dst, dst_ids, block_bytes=65536, num_warps=8)

        variants = {
            "ipc": lambda seg: path_copy(sources["ipc"], seg),
            "own": lambda seg: path_copy(sources["own"], seg),
            "ipc_64k_8w": lambda seg: wide_copy(sources["ipc"], seg),
            "own_64k_8w": lambda seg: wide_copy(sources["own"], seg),
            "torch": lambda seg: self.raw_buf[:nbytes].copy_(self.peer_src[:nbytes]),
        }
        times: dict[str, list[float]] = {k: [] for k in (*variants, "launch_host")}
        with torch.cuda.device(dev):
            for rep in range(self.args.repeats + 1):  # the first round warms up (compiles)
                order = list(variants)
                order = order[rep % len(order) :] + order[: rep % len(order)]
                for which in order:
                    src = self.rng.permutation(self.num_pages - 1)[:n] + 1
                    dst = self.rng.permutation(self.num_pages - 1)[:n] + 1
                    seg = [Segment("full", "full", src, dst, page)]
                    torch.cuda.synchronize()
                    begin = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    begin.record()
                    t0 = time.perf_counter()
                    variants[which](seg)
                    host = time.perf_counter() - t0
                    end.record()
                    torch.cuda.synchronize()
                    if rep == 0:
                        continue
                    times[which].append(begin.elapsed_time(end) / 1e3)
                    if which == "ipc":
                        times["launch_host"].append(host)
        med = {k: statistics.median(v) for k, v in times.items()}
        print("    the copy alone, GPU time (median ms, GB/s of the bytes moved):", flush=True)
        for k in variants:
            print(f"      {k:11s} {1e3 * med[k]:8.3f} ms {nbytes / med[k] / 1e9:7.0f} GB/s")
        print(f"      host time of the path's launch call: {1e3 * med['launch_host']:.3f} ms")
        return {f"{k}_ms": 1e3 * v for k, v in med.items()}

    def report(self, mib: int, row: dict[str, Any]) -> None:
        for path in self.args.paths:
            r = row[path]
            print(
                f"{mib:5d} MiB {path:8s} {r['ms']:8.2f} ms {r['gbps']:6.2f} GB/s | baseline "
                f"{r['baseline_ms']:8.2f} ms {r['baseline_gbps']:6.2f} GB/s | ratio "
                f"{r['ratio']:.2f} [{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}] | fixed "
                f"{r['fixed_ms']:.2f} [{r['fixed_ms_q1']:.2f}-{r['fixed_ms_q3']:.2f}] ms | CPU "
                f"{r['cpu_ms']:.2f} ms (baseline {r['baseline_cpu_ms']:.2f}) | load "
                f"{os.getloadavg()[0]:.1f}",
                flush=True,
            )
            if "pages_ms" in r:
                print(
                    f"{'':9s} raw ucxx, a message per page {r['pages_ms']:8.2f} ms, CPU "
                    f"{r['pages_cpu_ms']:.2f} ms | ours / it {r['ratio_to_pages']:.2f} "
                    f"[{r['ratio_to_pages_q1']:.2f}-{r['ratio_to_pages_q3']:.2f}] | it / baseline "
                    f"{r['pages_ratio']:.2f} [{r['pages_ratio_q1']:.2f}-{r['pages_ratio_q3']:.2f}]",
                    flush=True,
                )

    def close(self) -> None:
        for receiver in self.receivers.values():
            receiver.close()
        self.ask("close")
        self.proc.join(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(30)


def _median_quartiles(name: str, values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {name: statistics.median(values), f"{name}_q1": q[0], f"{name}_q3": q[2]}


BASELINES = {
    "ucx": "raw ucxx send/recv of the same bytes (request + one message)",
    "host_shm": "in-process copy of the same pages (duet_kernels.copy_pages)",
    "cuda_ipc": "torch peer copy of the same bytes",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        help="MiB per pull (default: CPU 1 4 16 64, GPU 1 16 64 256 1024)",
    )
    ap.add_argument("--paths", nargs="+", help="default: ucx host_shm (CPU), ucx cuda_ipc (GPU)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--staging-tokens", type=int, default=1024)
    ap.add_argument(
        "--progress-mode",
        choices=list(PROGRESS_MODES),
        default="auto",
        help="UCX progress mode of both sides (transfer.progress_mode; auto: as a worker of the "
        "first path would run)",
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="direct paths: print where each pull's time goes (median time of each stage on D "
        "and P), and on GPUs the copy kernel alone from P's pools, from D's own memory and the "
        "baseline's copy",
    )
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.sizes = args.sizes or ([1, 16, 64, 256, 1024] if cuda else [1, 4, 16, 64])
    args.paths = args.paths or ["ucx", "cuda_ipc" if cuda else "host_shm"]
    modes = {
        p: config(
            args.device, p != "ucx", args.staging_tokens, args.progress_mode
        ).ucx_progress_mode(cuda)
        for p in args.paths
    }
    if len(set(modes.values())) > 1:
        # One UCX runtime per process: the first path's mode is every path's here.
        print(
            f"note: a worker would progress UCX as {modes}; in this run every path runs in "
            f"{modes[args.paths[0]]!r} (run a path alone, or pass --progress-mode)",
            flush=True,
        )
    # Both processes in the mode a worker of the first path would run (P's sender, which also
    # serves direct reads, would otherwise pick its own).
    asked, args.progress_mode = args.progress_mode, modes[args.paths[0]]
    bench = Bench(args)
    try:
        results = bench.run()
    finally:
        bench.close()
    results["setup"] = {
        "device": args.device,
        "devices": [bench.p_dev, bench.d_dev],
        "cores": os.cpu_count(),
        "page_bytes": bench.spec.page_bytes,
        "repeats": args.repeats,
        "staging_tokens": args.staging_tokens,
        "progress_mode": asked,
        "ucx_progress_mode": args.progress_mode,
        "baselines": {p: BASELINES[p] for p in args.paths},
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
