"""Experiment: what did the end of a direct read cost a pull, before the done board? Runs
scripts/bench_transfer.py (arguments after the variant) with parts of the decode side patched out:

    python scripts/experiment_read_end.py {base,spin,nodone,spin-nodone} --device cuda \\
        --paths direct --hot --layouts scattered --min-mib 16 --max-mib 256 --repeats 11

``spin``: the copy wait never lets go of the GIL (no ``time.sleep(0)`` after 200 us). ``nodone``:
nothing is handed to the transceiver's loop thread (``UcxRuntime.call_soon`` does nothing), which
at commit 81cebd4 meant no ReadDone, so P kept its leases (the benchmark's P does not need them
back). The results of that commit are in docs/benchmarks/read_end_experiment/ and
docs/benchmarks/transfer.md ("Seventh pass"); since the done board, a read that succeeds hands
nothing to the loop, so ``nodone`` changes only failed reads.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def spin(event, timeout):
    if event is None:
        return True
    start = time.monotonic()
    while not event.query():
        if time.monotonic() - start > timeout:
            return False
    return True


# Guarded: the benchmark spawns P, whose interpreter imports this file again.
if __name__ == "__main__":
    import bench_transfer

    import transfer.direct_read as direct_read
    import transfer.runtime as runtime

    variant = sys.argv[1]
    if "spin" in variant:
        direct_read.wait_copy_blocking = spin
    if "nodone" in variant:
        runtime.UcxRuntime.call_soon = lambda self, fn, *args: None
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    bench_transfer.main()
