"""A worker's torch threads follow the CPUs it was given, within the cores it may use; a niced
worker returns to the default priority where the OS allows it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from engine.cpu_share import configure_cpu_threads, usable_cores


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_follow_num_cpus_within_the_usable_cores() -> None:
    cores = usable_cores()
    assert configure_cpu_threads(1.0) == 1 and torch.get_num_threads() == 1
    assert configure_cpu_threads(0.5) == 1  # a fractional share still runs one thread
    assert configure_cpu_threads(cores + 3.0) == cores
    assert configure_cpu_threads(None) == cores and torch.get_num_threads() == cores


def test_other_devices_are_left_alone() -> None:
    torch.set_num_threads(1)
    assert configure_cpu_threads(4.0, "cuda:0") is None
    assert torch.get_num_threads() == 1


def test_a_niced_process_returns_to_priority_zero_when_allowed() -> None:
    # A child started at niceness 15, as Ray starts its workers.
    code = "from engine.cpu_share import restore_default_priority as r; print(r())"
    out = subprocess.run(
        ["nice", "-n", "15", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    niceness = int(out.stdout.strip())
    if os.geteuid() == 0:  # root may always lower it
        assert niceness == 0
    else:  # others only with CAP_SYS_NICE or a RLIMIT_NICE that allows it
        assert niceness in (0, 15)
