"""The two processes of the transfer benchmarks (bench_transfer.py, profile_direct_read.py,
probe_read_path.py) and their KV geometry: the prefill side (KVSender, plus a raw ucxx server) runs
in a spawned child on cuda:0 or the CPU and answers commands on a pipe; the caller is the decode
side."""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import statistics
import threading
import time
from typing import Any

import torch
from transfer_baselines import DATA_TAG, REQ_TAG

from kvcache.spec import PoolGroupSpec
from transfer import KVReceiver, KVSender, TransceiverConfig

MIB = 1 << 20


def bench_spec(max_bytes: int) -> PoolGroupSpec:
    """32 layers, 2 KV heads of 64, 16 tokens a page, bf16: one page is exactly 256 KiB."""
    pages = max_bytes // (256 * 1024) + 2
    return PoolGroupSpec("full", tuple(range(32)), pages, 16, 2, 64, torch.bfloat16)


def probe_settings(device: str, sizes_mib: list[int], progress_mode: str = "auto") -> Any:
    """The settings ``config`` and ``start_prefill`` read, for the probes that do not take the
    benchmark's options (the benchmark's defaults)."""
    return argparse.Namespace(
        device=device,
        max_mib=max(sizes_mib),
        staging_tokens=16384 if device == "cuda" else 512,
        staging_buffers=4,
        progress_mode=progress_mode,
        proto_info=False,
    )


def pool_bytes(buf: torch.Tensor, spec: PoolGroupSpec) -> torch.Tensor:
    return buf.view(-1).view(torch.uint8).view(spec.num_pages, spec.page_bytes)


def page_sums(buf: torch.Tensor, spec: PoolGroupSpec, pages: list[int]) -> list[list[int]]:
    """Per page, three sums of its bytes: plain, weighted by position, and weighted again after a
    modulus. Bytes moved within a page (reversed, swapped halves, swapped bytes of a value) change
    them, as do other bytes; 16 pages at a time, to bound the int64 temporary."""
    rows = pool_bytes(buf, spec)
    w = torch.arange(1, spec.page_bytes + 1, device=buf.device, dtype=torch.int64)
    out: list[list[int]] = []
    for start in range(0, len(pages), 16):
        r = rows[torch.tensor(pages[start : start + 16], device=buf.device)].to(torch.int64)
        rw = r * w
        out += torch.stack([r.sum(1), rw.sum(1), (rw % 1_000_003 * w).sum(1)], 1).tolist()
    return out


def config(args: argparse.Namespace, direct_copy: bool = True) -> TransceiverConfig:
    env = {
        "UCX_TLS": "tcp,self" if args.device == "cpu" else "tcp,cuda_copy,cuda_ipc",
        "UCX_NET_DEVICES": "lo",
    }
    if args.proto_info:
        env["UCX_PROTO_INFO"] = "y"  # UCX prints the protocol and transport of each message kind
    return TransceiverConfig(
        staging_tokens=args.staging_tokens,
        staging_buffers=args.staging_buffers,
        progress_mode=args.progress_mode,
        direct_copy=direct_copy,
        prestage=getattr(args, "prestage", True),
        host_iov=getattr(args, "host_iov", True),
        piece_chunk_tokens=getattr(
            args, "piece_chunk_tokens", TransceiverConfig.piece_chunk_tokens
        ),
        lease_s=120,
        pull_deadline_s=60,
        chunk_deadline_s=60,
        done_deadline_s=60,
        ucx_env=env,
    )


def prefill_main(conn: Any, args: argparse.Namespace) -> None:
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    spec = bench_spec(args.max_mib * MIB)
    buf = torch.randint(-30000, 30000, spec.buffer_shape, dtype=torch.int16, device=device).view(
        torch.bfloat16
    )
    sender = KVSender({"full": buf}, [spec], "bench", config(args), release=lambda rid: None)
    runtime = sender.runtime
    raw = torch.randint(0, 255, (args.max_mib * MIB,), dtype=torch.uint8, device=device)
    conn.send((sender.port, runtime.worker_address))
    parent_address = conn.recv()

    async def raw_server() -> None:
        ep = await runtime.create_endpoint(parent_address)
        size = torch.zeros(1, dtype=torch.int64)
        while True:
            await runtime.ctx.recv(size.numpy(), tag=REQ_TAG)
            n = int(size[0])
            if n == 0:
                return
            data = raw[:n]
            await ep.send(
                data.numpy() if data.device.type == "cpu" else data, tag=DATA_TAG, force_tag=True
            )

    raw_task = runtime.submit(raw_server())
    while True:
        cmd, *rest = conn.recv()
        if cmd == "publish":  # nothing else: a pull is timed right after this answer
            rid, pages = rest
            conn.send(sender.publish(rid, {"full": pages}, len(pages) * spec.page_size))
        elif cmd == "sums":  # of pages a checked pull read, asked after it (page_sums)
            conn.send(page_sums(buf, spec, rest[0]))
        elif cmd == "ping":  # the same round trip as a publish, before a timed peer copy
            conn.send("pong")
        elif cmd == "set":  # scripts/probe_ab.py: a module attribute of this (prefill) process
            module, attr, value = rest
            setattr(importlib.import_module(module), attr, value)
            conn.send("set")
        elif cmd == "threads":  # scripts/probe_cpu_cost.py: native thread id -> name
            conn.send({t.native_id: t.name for t in threading.enumerate()})
        elif cmd == "stop":
            raw_task.result(timeout=60)
            stats = sender.stats()
            sender.close()
            conn.send(stats)
            return


def overwrite(buf: torch.Tensor, spec: PoolGroupSpec, pages: list[int]) -> None:
    """Fill D's ``pages`` with a byte no sent page is made of, before a checked pull: a pull that
    writes nothing must not pass on an earlier run's bytes. Done before the timed pull starts."""
    pool_bytes(buf, spec)[torch.tensor(pages, device=buf.device)] = 0xA5
    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)


def sums_of(conn: Any, pages: list[int]) -> list[list[int]]:
    """P's page_sums of its ``pages``, asked after the pull that read them: P's answer before a
    pull is the publish alone, as before a timed peer copy (a bare ping), so that both start from
    the same idle GPUs (sums of 1 GiB of pages keep P busy for tens of ms)."""
    conn.send(("sums", pages))
    return conn.recv()


LAYOUTS = ("contiguous", "scattered", "p-run", "d-run")


def choose_pages(
    n: int, spec: PoolGroupSpec, layout: str, gen: torch.Generator, side: str = "p"
) -> list[int]:
    """``n`` page ids of one side ("p" or "d") of a pull: one run ("contiguous", and "p-run" /
    "d-run" on that side) or a random permutation ("scattered", and the other side of those)."""
    if layout in ("contiguous", f"{side}-run"):
        return list(range(1, n + 1))
    return (torch.randperm(spec.num_pages - 1, generator=gen)[:n] + 1).tolist()


def start_prefill(args: argparse.Namespace) -> tuple[Any, Any, bytes]:
    """The prefill side in a spawned process: (pipe to it, the process, its UCX worker address).
    It waits for our worker address (``conn.send``) before serving."""
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=prefill_main, args=(child_conn, args), daemon=True)
    child.start()
    child_conn.close()  # ours: a child that dies then closes the pipe, and recv raises
    deadline = time.monotonic() + 300  # (a GPU child compiles and warms up first)
    while not conn.poll(1.0):
        if not child.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the prefill process did not start (exit code {child.exitcode})")
    _port, child_address = conn.recv()
    return conn, child, child_address


def cpu_decode_side(
    settings: argparse.Namespace, size_mib: int, conn: Any, child_address: bytes
) -> tuple[PoolGroupSpec, KVReceiver, Any, torch.Tensor]:
    """The probes' decode side on the CPU, next to ``start_prefill``'s process: (KV geometry, a
    receiver on the UCX path, a raw ucxx endpoint to P, a buffer for raw_once of ``size_mib``)."""
    spec = bench_spec(size_mib * MIB)
    buf = torch.zeros(spec.buffer_shape, dtype=spec.dtype)
    receiver = KVReceiver({"full": buf}, [spec], "bench", config(settings, direct_copy=False))
    conn.send(receiver.runtime.worker_address)
    raw_ep = receiver.runtime.run(receiver.runtime.create_endpoint(child_address), timeout=30)
    return spec, receiver, raw_ep, torch.empty(size_mib * MIB, dtype=torch.uint8)


class PatchedModule:
    """A module with some functions replaced, for the probes that time its calls (a C module's
    attributes cannot be set)."""

    def __init__(self, module: Any, **functions: Any) -> None:
        self._module = module
        self.__dict__.update(functions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def paired_ratios(row: dict[str, Any], times: dict[str, list[float]], base: str) -> None:
    """Adds, for each variant timed in the same repetitions as ``base``, the median and quartiles
    of base time / variant time taken repetition by repetition (``*_paired_vs_<base>``,
    ``*_paired_q_<base>``). Pairs run back to back, so a busy spell of a shared host that slows
    both cancels out, where the ratio of two medians can pair a quiet spell with a busy one."""
    ref = times.get(base, [])
    for key, ts in times.items():
        if key == base or key.endswith("_hot") or len(ts) != len(ref) or len(ts) < 2:
            continue
        ratios = [b / t for b, t in zip(ref, ts, strict=True)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        row[f"{key}_paired_vs_{base}"] = statistics.median(ratios)
        row[f"{key}_paired_q_{base}"] = [q1, q3]


def format_row(row: dict[str, Any]) -> str:
    parts = [f"{row['bytes'] / MIB:>6.0f} MiB"]
    for key, value in row.items():
        if key.endswith("_path"):
            parts.append(f"{key} {value}")
        if key.endswith("_gbps"):
            parts.append(f"{key[:-5]} {value:7.2f} GB/s")
        elif "_vs_" in key:
            parts.append(f"{key} {value:5.2f}")
        elif "_paired_q_" in key:
            parts.append(f"{key} [{value[0]:.2f}, {value[1]:.2f}]")
        elif key.endswith("_error"):
            parts.append(f"{key}: {value}")
    return " | ".join(parts)


def gil_load(stop: threading.Event) -> None:
    """A thread that runs Python without pause until ``stop``, as a worker's engine thread can:
    the worst case for a pull that lets go of the GIL while it waits."""
    x = 0
    while not stop.is_set():
        for _ in range(1000):
            x += 1
