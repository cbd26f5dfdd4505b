"""How much of a direct read's time after P's answer is ours to cut: the full pull
(``pull_blocking``) next to the same read cut to its bare steps (the C launch, the wait for the
copy, one board word, one done-board record: no checks, no stats) and a torch peer copy, each
right after a pipe round trip to P, interleaved, medians in microseconds. P runs on cuda:0 in a
spawned process (scripts/transfer_bench_setup.py), D here on cuda:1.

The bare read is not a pull (it checks nothing and skips the receiver's bookkeeping); it only
bounds what trimming the pull's Python could win. It found that the checks were on the latency
path of 16 MiB reads (docs/benchmarks/transfer.md, fourteenth pass).

    python scripts/probe_lean_pull.py [--sizes-mib 16 64] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transfer_baselines import peer_buffers, peer_copy_once  # noqa: E402
from transfer_bench_setup import (  # noqa: E402
    MIB,
    bench_spec,
    choose_pages,
    config,
    probe_settings,
    start_prefill,
)

from transfer import KVReceiver  # noqa: E402


def bare_read(r: KVReceiver, t: Any, dst: list[int]) -> float:
    """The steps no direct read can skip, timed like a pull; the lease must be live."""
    start = time.perf_counter()
    access = r.links.open[(t.host, t.port)].access
    c = r.direct_copier
    slot = c._take(0)
    c._native.queue(
        c._context,
        c._handle,
        c._model.cuda_stream,
        c._model_mark.cuda_event,
        slot.handle,
        slot.src_at,
        slot.dst_at,
        c.capacity,
        ((access.route.pairs[0][2], t.page_ids["full"], dst, 0),),
    )
    slot.busy = True
    while not slot.query():
        pass
    word = access.board.word(t.lease_slot)
    access.done.post(t.lease_slot, t.lease_gen, 1, 1, access.data_path)  # P releases the lease
    slot.held = False
    elapsed = time.perf_counter() - start
    if not word & 1:
        raise RuntimeError("the lease was not live")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=30)
    cli = parser.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit("needs 2 GPUs")
    args = probe_settings("cuda", cli.sizes_mib)
    spec = bench_spec(args.max_mib * MIB)
    conn, child, _ = start_prefill(args)
    torch.cuda.set_device(1)
    buf = torch.zeros(spec.buffer_shape, dtype=spec.dtype, device="cuda:1")
    r = KVReceiver({"full": buf}, [spec], "bench", config(args))
    conn.send(r.runtime.worker_address)
    gen = torch.Generator().manual_seed(0)

    def publish(n: int, name: str) -> Any:
        conn.send(("publish", name, choose_pages(n, spec, "scattered", gen)))
        return conn.recv()

    def full(t: Any, dst: list[int]) -> float:
        start = time.perf_counter()
        result = r.pull_blocking(t, {"full": dst}, 0, t.declared_prompt_len)
        elapsed = time.perf_counter() - start
        if not result.ok or result.stats.path != "cuda_ipc":
            raise RuntimeError(f"not a direct read: {result.error} {result.stats.path}")
        return elapsed

    full(publish(16, "first"), choose_pages(16, spec, "scattered", gen))  # link, route, kernel
    for size in cli.sizes_mib:
        n = size * MIB // spec.page_bytes
        peer = peer_buffers(size * MIB)
        times: dict[str, list[float]] = {"pull": [], "bare": [], "peer": []}
        for rep in range(cli.repeats + 1):
            for mode, got in times.items():
                if mode == "peer":
                    conn.send(("ping",))
                    conn.recv()
                    elapsed = peer_copy_once(*peer)
                else:
                    ticket = publish(n, f"{mode}-{size}-{rep}")
                    dst = choose_pages(n, spec, "scattered", gen)
                    elapsed = full(ticket, dst) if mode == "pull" else bare_read(r, ticket, dst)
                if rep:  # (one warm-up)
                    got.append(elapsed)
        us = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        print(
            f"{size:5d} MiB after P's answer, medians of {cli.repeats}, us: "
            + " | ".join(f"{k} {v:.1f}" for k, v in us.items())
            + f" | peer/pull {us['peer'] / us['pull']:.2f} | peer/bare {us['peer'] / us['bare']:.2f}",
            flush=True,
        )
    r.close()
    child.terminate()  # (its raw ucxx server would wait for a stop message)
    child.join(30)


if __name__ == "__main__":
    main()
