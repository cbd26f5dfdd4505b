"""Probe: settings of either side on and off, pull by pull, next to raw ucxx, in one run.

Runs the benchmark's prefill process (scripts/transfer_bench_setup.py) and a decode-side receiver
on the CPU, as scripts/bench_transfer.py does, and alternates each repetition's order: a pull with
every switched attribute at its ON value, one with its OFF value (or the other way round), then
raw ucxx of the same bytes. Scattered pages (``--layout``), UCX path. Prints the median pull
times, the median of the per-repetition ratios OFF/ON (below 1: OFF is faster) and the quartiles
of raw/ON and raw/OFF. ``--set`` switches a module attribute of the decode process (this one),
``--set-p`` one of the prefill process (through its pipe, before each pull), and ``--config-b``
sends the OFF pulls through a second receiver of this process whose TransceiverConfig differs in
the fields named (its own link to P: a setting agreed once per link, as the piece chunk size).

    python scripts/probe_ab.py --size-mib 256 --pulls 40 \\
        --set transfer.mapper.SMALL_RUNS 32 10**9 --set transfer.ucp_iov.SMALL_RUNS 32 10**9
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from transfer_baselines import raw_once, send_stop  # noqa: E402
from transfer_bench_setup import (  # noqa: E402
    LAYOUTS,
    choose_pages,
    config,
    cpu_decode_side,
    probe_settings,
    start_prefill,
)

from transfer import KVReceiver  # noqa: E402

MIB = 1 << 20
WARM_UP = 2  # repetitions left out of the figures


def settings_of(pairs: list[list[str]]) -> list[tuple[Any, str, Any, Any]]:
    """(module, attribute, ON value, OFF value) for each ``--set NAME ON OFF`` (values are Python
    literals, or ``a**b``)."""
    out = []
    for name, on, off in pairs:
        module, attr = name.rsplit(".", 1)
        mod = importlib.import_module(module)
        if not hasattr(mod, attr):
            raise SystemExit(f"{module} has no attribute {attr!r}")
        out.append((mod, attr, _value(on), _value(off)))
    return out


def _value(text: str) -> Any:
    if "**" in text:
        base, exp = text.split("**")
        return ast.literal_eval(base) ** ast.literal_eval(exp)
    return ast.literal_eval(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1)
    parser.add_argument("--pulls", type=int, default=60, help="repetitions (each: ON, OFF, raw)")
    parser.add_argument("--layout", choices=LAYOUTS, default="scattered")
    parser.add_argument(
        "--set", nargs=3, action="append", default=[], metavar=("NAME", "ON", "OFF")
    )
    parser.add_argument(
        "--set-p",
        nargs=3,
        action="append",
        default=[],
        metavar=("NAME", "ON", "OFF"),
        help="the same in the prefill process",
    )
    parser.add_argument(
        "--config-b",
        nargs=2,
        action="append",
        default=[],
        metavar=("FIELD", "VALUE"),
        help="OFF pulls through a second receiver with this TransceiverConfig field changed",
    )
    args = parser.parse_args()
    if not args.set and not args.set_p and not args.config_b:
        parser.error("nothing to switch: give --set, --set-p or --config-b")
    sets = settings_of(args.set)
    p_sets = [(name, _value(on), _value(off)) for name, on, off in args.set_p]
    settings = probe_settings("cpu", [args.size_mib])
    conn, child, child_address = start_prefill(settings)
    spec, receiver, raw_ep, raw_dst = cpu_decode_side(settings, args.size_mib, conn, child_address)
    runtime = receiver.runtime
    receivers = {True: receiver, False: receiver}
    if args.config_b:
        changed = {name: _value(value) for name, value in args.config_b}
        receivers[False] = KVReceiver(
            {"full": torch.zeros(spec.buffer_shape, dtype=spec.dtype)},
            [spec],
            "bench",
            dataclasses.replace(config(settings, direct_copy=False), **changed),
        )
    gen = torch.Generator().manual_seed(0)
    n = args.size_mib * MIB // spec.page_bytes
    times: dict[Any, list[float]] = {True: [], False: [], "raw": []}
    for rep in range(args.pulls):
        for on in (True, False) if rep % 2 else (False, True):
            for mod, attr, on_value, off_value in sets:
                setattr(mod, attr, on_value if on else off_value)
            for name, on_value, off_value in p_sets:
                conn.send(("set", *name.rsplit(".", 1), on_value if on else off_value))
                conn.recv()
            src = choose_pages(n, spec, args.layout, gen, "p")
            dst = choose_pages(n, spec, args.layout, gen, "d")
            conn.send(("publish", f"ab-{rep}-{on}", src))
            ticket = conn.recv()
            start = time.perf_counter()
            result = receivers[on].pull_blocking(
                ticket, {"full": dst}, 0, ticket.declared_prompt_len
            )
            elapsed = time.perf_counter() - start
            if not result.ok:
                raise RuntimeError(result.error)
            if rep >= WARM_UP:
                times[on].append(elapsed)
        elapsed = raw_once(runtime, raw_ep, raw_dst, args.size_mib * MIB)
        if rep >= WARM_UP:
            times["raw"].append(elapsed)
    runtime.run(send_stop(raw_ep), timeout=30)
    conn.send(("stop",))
    conn.recv()
    child.join(60)
    if receivers[False] is not receiver:
        receivers[False].close()
    receiver.close()
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    off_on = statistics.median(b / a for a, b in zip(times[True], times[False]))

    def quartiles(key: Any) -> list[float]:
        ratios = [r / t for t, r in zip(times[key], times["raw"])]
        return [round(q, 2) for q in statistics.quantiles(ratios, n=4)]

    names = [f"{m.__name__}.{a}" for m, a, on, off in sets if on != off]
    names += [f"P {n}" for n, on, off in p_sets if on != off]
    names += [f"OFF receiver {name}={value}" for name, value in args.config_b]
    print(
        f"{args.size_mib} MiB {args.layout} {names}: ON {ms[True]:.3f} ms, OFF "
        f"{ms[False]:.3f} ms, raw {ms['raw']:.3f} ms; paired OFF/ON {off_on:.3f}; raw/ON q "
        f"{quartiles(True)}, "
        f"raw/OFF q {quartiles(False)} ({len(times['raw'])} repetitions)"
    )


if __name__ == "__main__":
    main()
