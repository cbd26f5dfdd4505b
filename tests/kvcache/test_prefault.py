"""kvcache/prefault.py: host pools are faulted in by a background thread, without changing what
the engine writes meanwhile, and left lazy when the host lacks the memory."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import pytest
import torch

from kvcache import prefault as prefault_module
from kvcache.kv_buffer import allocate_buffers, shared_zeros
from kvcache.prefault import prefault
from kvcache.spec import PoolGroupSpec

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")


@pytest.fixture(autouse=True)
def _prefault_on(monkeypatch) -> None:
    monkeypatch.setenv("DUET_PREFAULT_KV", "1")  # tests/conftest.py turns it off for the others


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _write_all(t: torch.Tensor) -> int:
    """Minor faults taken by writing every byte of ``t``."""
    before = _faults()
    t.view(torch.uint8).view(-1).fill_(7)
    return _faults() - before


def test_a_populated_pool_takes_no_faults_when_written() -> None:
    pool = shared_zeros((16, 1 << 20), torch.float32, "test")  # 64 MiB
    thread = prefault(pool)
    assert thread is not None
    thread.join(timeout=60)
    assert thread.populated_bytes >= pool.numel() * 4
    assert thread.idle  # it takes only CPU time the engine leaves
    assert _write_all(pool) < 64  # 16384 pages of 4 KiB, already mapped writable


def test_an_unpopulated_pool_faults_on_first_write() -> None:
    # The baseline the test above is measured against: the same write without populating.
    pool = shared_zeros((16, 1 << 20), torch.float32, "test")
    assert _write_all(pool) > 4096


def test_contents_written_during_populating_are_kept() -> None:
    pool = shared_zeros((64, 1 << 18), torch.float32, "test")  # 64 MiB
    pool[:32] = torch.arange(32 * (1 << 18), dtype=torch.float32).view(32, -1)
    thread = prefault(pool)
    assert thread is not None
    pool[32:] = 3.0  # the engine writing while the thread runs
    thread.join(timeout=60)
    assert torch.equal(pool[:32].reshape(-1), torch.arange(32 * (1 << 18), dtype=torch.float32))
    assert bool((pool[32:] == 3.0).all())


def test_a_dropped_pool_is_not_held_or_populated() -> None:
    pool = shared_zeros((4, 1 << 20), torch.float32, "test")
    ref = weakref.ref(pool)
    thread = prefault_module.Prefaulter(pool)
    del pool
    assert ref() is None  # the thread does not keep the pool alive
    thread.start()
    thread.join(timeout=60)
    assert thread.populated_bytes == 0


def test_the_opt_out_leaves_pools_lazy(monkeypatch) -> None:
    monkeypatch.setenv("DUET_PREFAULT_KV", "0")
    assert prefault(shared_zeros((4, 1 << 20), torch.float32, "test")) is None


def test_a_pool_larger_than_available_memory_stays_lazy(monkeypatch) -> None:
    monkeypatch.setattr(prefault_module, "available_bytes", lambda: 1 << 20)
    pool = shared_zeros((4, 1 << 20), torch.float32, "test")  # 16 MiB > 1 MiB available
    assert prefault(pool) is None


def test_host_pools_are_populated_from_allocation() -> None:
    spec = PoolGroupSpec(
        name="full",
        layer_ids=(0, 1, 2, 3),
        num_pages=64,
        page_size=16,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
    )
    buffers = allocate_buffers([spec], torch.device("cpu"))
    for thread in threading.enumerate():
        if thread.name == "kv-prefault":
            thread.join(timeout=60)
    assert _write_all(buffers["full"]) < 16


def test_no_populating_thread_outlives_the_interpreters_exit() -> None:
    """At exit every populating thread stops at its next chunk and is joined, before the
    interpreter shuts down: a daemon thread still running then was ended inside torch's release
    of a pool the main thread had dropped, and the process aborted. The probe's own exit hook,
    registered before the module's, runs after it (atexit runs hooks last in, first out)."""
    script = textwrap.dedent(
        """
        import atexit, threading
        def check():
            alive = [t for t in threading.enumerate() if t.name == "kv-prefault" and t.is_alive()]
            print("alive at exit:", len(alive), flush=True)
        atexit.register(check)
        import torch
        from kvcache.kv_buffer import shared_zeros
        from kvcache.prefault import prefault
        pool = shared_zeros((1 << 30,), torch.uint8, "exit-probe")  # seconds to populate
        assert prefault(pool) is not None
        del pool  # the thread holds the last reference during its calls
        """
    )
    env = {**os.environ, "DUET_PREFAULT_KV": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "alive at exit: 0" in done.stdout, done.stdout
