"""The Triton kernels against their references, run by the Triton interpreter on CPU.

The cases run in one subprocess (tests/duet_kernels/interpret_cases.py) with TRITON_INTERPRET=1: the
flag is read when a kernel is defined, so setting it in this process would turn every later
Triton kernel of the test session into an interpreted one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.duet_kernels.interpret_cases import CASES

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, float]:
    env = dict(os.environ, TRITON_INTERPRET="1", DUET_KERNELS="triton", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.duet_kernels.interpret_cases"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_kernel_matches_reference(case: str, interpreter_errors: dict[str, float]) -> None:
    tolerance = CASES[case][1]
    error = interpreter_errors[case]
    assert error <= tolerance, f"{case}: max abs error {error} > {tolerance}"
