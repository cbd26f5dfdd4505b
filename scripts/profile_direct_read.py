"""Where the time of a direct read goes (transfer/direct_read.py), on the 2-GPU machine: P in a
spawned process on cuda:0 (scripts/bench_transfer.py's prefill side), D here on cuda:1. Prints the
median of each phase (checks, launch, wait for the copy, finish) per size, then a cProfile of one
size (--profile-mib).

    python scripts/profile_direct_read.py [--device cpu]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_transfer import MIB, bench_spec, choose_pages, config, start_prefill  # noqa: E402

import kernels  # noqa: E402
import transfer.direct_read as dr  # noqa: E402
import transfer.ipc as ipc  # noqa: E402
from transfer import KVReceiver  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile-mib", type=int, default=16, help="the size cProfile watches")
    parser.add_argument("--progress-mode", default="auto")
    cli = parser.parse_args()
    args = argparse.Namespace(
        device=cli.device,
        max_mib=max(cli.sizes_mib),
        staging_tokens=16384 if cli.device == "cuda" else 512,
        staging_buffers=4,
        progress_mode=cli.progress_mode,
        proto_info=False,
    )
    spec = bench_spec(args.max_mib * MIB)
    conn, child, _ = start_prefill(args)
    device = torch.device("cuda:1" if cli.device == "cuda" else "cpu")
    buf = torch.zeros(spec.buffer_shape, dtype=spec.dtype, device=device)
    receiver = KVReceiver({"full": buf}, [spec], "bench", config(args))
    conn.send(receiver.runtime.worker_address)  # the child's raw-ucxx server wants it

    phases: dict[str, list[float]] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases.setdefault(name, []).append(time.perf_counter() - start)

        return wrapper

    dr.DirectRead._check = timed("check", dr.DirectRead._check)
    dr.DirectRead._launch = timed("launch", dr.DirectRead._launch)
    dr.DirectRead._finish = timed("finish", dr.DirectRead._finish)
    dr.wait_copy_blocking = timed("wait", dr.wait_copy_blocking)
    # Inside the phases: the digest, the ticket checks and the plan (check), the kernel launch
    # itself (launch; the rest of it is the id upload and stream bookkeeping).
    dr.lease_digest = timed("check.digest", dr.lease_digest)
    dr.source_pages = timed("check.source_pages", dr.source_pages)
    dr.direct_plan = timed("check.plan", dr.direct_plan)
    ipc.kernels = types.SimpleNamespace(copy_pages=timed("launch.kernel", kernels.copy_pages))
    gen = torch.Generator().manual_seed(0)
    profile = cProfile.Profile()
    for size in cli.sizes_mib:
        n = size * MIB // spec.page_bytes
        phases.clear()
        total = []
        for rep in range(cli.repeats + 1):
            src = choose_pages(n, spec, "scattered", gen)
            dst = choose_pages(n, spec, "scattered", gen)
            conn.send(("publish", f"p{size}-{rep}", src))
            ticket, _ = conn.recv()
            last = size == cli.profile_mib and rep > 0
            if last:
                profile.enable()
            start = time.perf_counter()
            result = receiver.pull_blocking(ticket, {"full": dst}, 0, ticket.declared_prompt_len)
            total.append(time.perf_counter() - start)
            if last:
                profile.disable()
            assert result.ok, result.error
        line = {k: round(statistics.median(v[1:]) * 1e3, 3) for k, v in phases.items()}
        pull_ms = statistics.median(total[1:]) * 1e3
        print(
            f"{size:5d} MiB ({n} pages, {result.stats.path}): pull {pull_ms:.3f} ms, phases ms {line}"
        )
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())
    receiver.close()
    child.terminate()  # a diagnostic: P's pages need no orderly release
    child.join(30)


if __name__ == "__main__":
    main()
