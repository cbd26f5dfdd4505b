"""engine/host_malloc.py: once a CPU engine is built, a large block freed and allocated again costs
no fresh page faults; with DUET_KEEP_FREED_MEMORY=0 (glibc's defaults) it does. Each case runs in a
process of its own, since the setting is process-wide and cannot be undone."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the setting is glibc's",
)

# A CPU engine on tiny weights, then rounds of a forward pass's pattern: a 64 MiB block (above
# glibc's largest dynamic mmap threshold, 32 MiB) and a 16 MiB one written, then freed. The first
# rounds may still grow the heap (torch's aligned allocations do not fit exactly the block freed
# before); the last round's minor faults say whether freed memory came back for reuse.
PROBE = """
import json, resource, torch
from tests.tiny_engine import tiny_engine
from engine.host_malloc import keep_freed_memory
engine = tiny_engine(num_pages=16)
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    before = faults()
    big = torch.empty(16 << 20); big.fill_(1.0)
    small = torch.empty(4 << 20); small.fill_(2.0)
    del big, small
print(json.dumps({"faults": faults() - before, "kept": keep_freed_memory()}))
"""


def _probe(env_extra: dict[str, str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_extra}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_engine_keeps_freed_memory_for_reuse() -> None:
    result = _probe({})
    assert result["kept"] is True
    assert result["faults"] < 256  # 80 MiB is 20480 pages of 4 KiB: none of them fault again


def test_opt_out_leaves_glibc_defaults() -> None:
    result = _probe({"DUET_KEEP_FREED_MEMORY": "0"})
    assert result["kept"] is False
    assert result["faults"] > 4096  # the block was given back and faults in again
