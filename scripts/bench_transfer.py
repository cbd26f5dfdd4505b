"""Benchmark: one request's KV moved P -> D by the transceiver, next to a baseline of the same bytes
measured in the same run.

    python scripts/bench_transfer.py                                  # CPU: ucx and host_shm
    python scripts/bench_transfer.py --device cuda --out transfer_gpu.json   # ucx and cuda_ipc

The parent process is the decode side (one KVReceiver per path), a spawned child the prefill side
(KVSender; on GPUs cuda:0, and D on cuda:1 when there is a second GPU, else cuda:0 too). Pages are
scattered on both sides (random page ids). Each pull is timed on D from ``pull`` to its result.
Baselines, per path:

- ucx: raw ucxx between the same two processes: D posts a receive of the same number of bytes and
  sends an 8-byte request, P answers with one contiguous message (a round trip, as a pull's
  request is).
- host_shm: an in-process copy of the same pages, with the same copy function (kernels.copy_pages)
  between two pools of D's process.
- cuda_ipc: a torch peer copy (``dst.copy_(src)``) of the same bytes from P's GPU to D's.

Every repetition runs each path and its baseline back to back, the order turning each time, so a
busy spell of a shared host hits both alike; a ratio (baseline time / path time) is taken per
repetition and reported as the median with quartiles. The first pull of each size is byte-checked
against P's pages. The JSON keeps every time.
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
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvcache.kv_buffer import allocate_buffers  # noqa: E402
from kvcache.spec import PoolGroupSpec  # noqa: E402
from transfer import KVReceiver, KVSender, TransceiverConfig  # noqa: E402
from transfer.mapper import Segment  # noqa: E402
from transfer.paths.direct import copy_segments  # noqa: E402
from transfer.pools import pool_rows  # noqa: E402
from transfer.runtime import UcxRuntime  # noqa: E402

MIB = 1 << 20
RAW_REQUEST, RAW_DATA = 0x5EED_0001, 0x5EED_0002
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


def config(device: str, direct: bool, staging_tokens: int) -> TransceiverConfig:
    tls = "tcp,self" if device == "cpu" else "tcp,cuda_copy,cuda_ipc"
    return TransceiverConfig(
        secret=SECRET,
        staging_tokens=staging_tokens,
        direct_copy=direct,
        ucx_env={"UCX_TLS": tls, "UCX_NET_DEVICES": "lo"},
        pull_deadline_s=60.0,
        chunk_deadline_s=60.0,
        lease_s=120.0,
        connect_deadline_s=60.0,
    )


def _digest(rows: torch.Tensor, pages: list[int]) -> str:
    data = rows[torch.tensor(pages, device=rows.device)].cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def prefill_proc(conn: Connection, device: str, num_pages: int, staging_tokens: int) -> None:
    """P: a KVSender over random pages, and the raw ucxx server of the baseline."""
    if device != "cpu":
        torch.cuda.set_device(device)
    s = spec("cpu" if device == "cpu" else "cuda", num_pages)
    buffers = allocate_buffers([s], torch.device(device))
    for b in buffers.values():
        b.view(torch.uint8).copy_(
            torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8)
        )
    rows = pool_rows(buffers, {"full": s.page_bytes})["full"]
    sender = KVSender(
        buffers, [s], "bench", config(device.split(":")[0], True, staging_tokens), lambda rid: None
    )
    runtime = sender.runtime
    raw = torch.randint(0, 256, (num_pages * s.page_bytes,), dtype=torch.uint8).to(device)
    conn.send((sender.port, runtime.worker_address))
    rng = np.random.default_rng(1)
    serving: Any = None
    while True:
        cmd, *args = conn.recv()
        if cmd == "publish":
            rid, n = args
            pages = (rng.permutation(num_pages - 1)[:n] + 1).tolist()
            conn.send((sender.publish(rid, {"full": pages}, n * 16), _digest(rows, pages)))
        elif cmd == "raw":  # serve raw requests from D's address until closed
            serving = runtime.submit(_serve_raw(runtime, args[0], raw))
            conn.send("serving")
        elif cmd == "close":
            if serving is not None:
                serving.cancel()
            sender.close()
            conn.send("closed")
            return


async def _serve_raw(runtime: UcxRuntime, address: bytes, buf: torch.Tensor) -> None:
    ep = await runtime.create_endpoint(address)
    size = np.zeros(1, dtype=np.int64)
    while True:
        await ep.recv(size, tag=RAW_REQUEST, force_tag=True)
        n = int(size[0])
        await ep.send(
            buf[:n].numpy() if buf.device.type == "cpu" else buf[:n], tag=RAW_DATA, force_tag=True
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
            args=(child, p_dev, self.num_pages, args.staging_tokens),
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
        self.receivers = {
            path: KVReceiver(
                self.buffers,
                [self.spec],
                "bench",
                config(args.device, path != "ucx", args.staging_tokens),
            )
            for path in args.paths
        }
        self.runtime = next(iter(self.receivers.values())).runtime
        self.rng = np.random.default_rng(2)
        self.count = 0
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

    def pull(self, path: str, n: int, check: bool) -> float:
        self.count += 1
        ticket, digest = self.ask("publish", f"r{self.count}", n)
        dst = (self.rng.permutation(self.num_pages - 1)[:n] + 1).tolist()
        start = time.perf_counter()
        result = self.receivers[path].pull_blocking(ticket, {"full": dst}, 0, n * 16)
        took = time.perf_counter() - start
        if not result.ok:
            raise RuntimeError(f"{path} pull of {n} pages failed: {result.error}")
        if check and _digest(self.rows, dst) != digest:
            raise RuntimeError(f"{path} pull of {n} pages: the bytes differ from P's")
        return took

    def baseline(self, path: str, n: int) -> float:
        nbytes = n * self.spec.page_bytes
        if path == "ucx":
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
        dst = self.raw_buf[:nbytes]
        start = time.perf_counter()
        recv = asyncio.ensure_future(
            self.ep.recv(
                dst.numpy() if dst.device.type == "cpu" else dst, tag=RAW_DATA, force_tag=True
            )
        )
        await self.ep.send(np.array([nbytes], dtype=np.int64), tag=RAW_REQUEST, force_tag=True)
        await recv
        return time.perf_counter() - start

    def run(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sizes": {}}
        for mib in self.args.sizes:
            n = self.pages_for[mib]
            row: dict[str, Any] = {"pages": n, "bytes": n * self.spec.page_bytes}
            for path in self.args.paths:
                self.pull(path, n, check=True)  # warm-up and byte check
                self.baseline(path, n)
                ours, base = [], []
                for rep in range(self.args.repeats):
                    first_ours = rep % 2 == 0  # the order turns each repetition
                    for which in ("ours", "base") if first_ours else ("base", "ours"):
                        if which == "ours":
                            ours.append(self.pull(path, n, check=False))
                        else:
                            base.append(self.baseline(path, n))
                ratios = sorted(b / o for o, b in zip(ours, base, strict=True))
                q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                row[path] = {
                    "ms": 1e3 * statistics.median(ours),
                    "baseline_ms": 1e3 * statistics.median(base),
                    "gbps": row["bytes"] / statistics.median(ours) / 1e9,
                    "baseline_gbps": row["bytes"] / statistics.median(base) / 1e9,
                    "ratio": statistics.median(ratios),
                    "ratio_q1": q[0],
                    "ratio_q3": q[2],
                    "times_s": ours,
                    "baseline_times_s": base,
                }
            out["sizes"][str(mib)] = row
            self.report(mib, row)
        return out

    def report(self, mib: int, row: dict[str, Any]) -> None:
        for path in self.args.paths:
            r = row[path]
            print(
                f"{mib:5d} MiB {path:8s} {r['ms']:9.2f} ms {r['gbps']:7.2f} GB/s | baseline "
                f"{r['baseline_ms']:9.2f} ms {r['baseline_gbps']:7.2f} GB/s | ratio {r['ratio']:.2f} "
                f"[{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}]",
                flush=True,
            )

    def close(self) -> None:
        for receiver in self.receivers.values():
            receiver.close()
        self.ask("close")
        self.proc.join(30)


BASELINES = {
    "ucx": "raw ucxx send/recv of the same bytes (request + one message)",
    "host_shm": "in-process copy of the same pages (kernels.copy_pages)",
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
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.sizes = args.sizes or ([1, 16, 64, 256, 1024] if cuda else [1, 4, 16, 64])
    args.paths = args.paths or ["ucx", "cuda_ipc" if cuda else "host_shm"]
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
        "baselines": {p: BASELINES[p] for p in args.paths},
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
