"""The UCX runtime: one per process, usable from any thread, and gone without a trace on release."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tests.transfer.conftest import MODEL, UCX_ENV, KVSide, config, specs
from transfer import KVSender, Transceiver
from transfer.config import TransceiverConfig, resolve_progress_mode
from transfer.runtime import DEFAULT_UCX_OPTIONS, UcxRuntime, context_options

pytestmark = pytest.mark.timeout(60)


def in_fresh_process(script: str) -> None:
    """Run ``script`` in a new Python process from the repository root; it prints "ok" last."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1].startswith("ok"), done.stdout[-2000:]  # UCX logs to stdout


def test_one_runtime_per_process_with_one_set_of_settings(ucx_runtime: UcxRuntime) -> None:
    again = UcxRuntime.acquire(UCX_ENV)
    try:
        assert again is ucx_runtime
    finally:
        again.release()
    with pytest.raises(ValueError, match="already runs with"):
        UcxRuntime.acquire({"UCX_TLS": "tcp"})


def test_submit_from_plain_threads_and_refuse_blocking_on_the_loop(ucx_runtime: UcxRuntime) -> None:
    async def where() -> bool:
        await asyncio.sleep(0.01)
        return ucx_runtime.on_loop()

    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda: results.append(ucx_runtime.run(where(), timeout=10)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [True] * 4

    async def nested() -> str:
        try:
            ucx_runtime.run(where(), timeout=1)
        except RuntimeError as e:
            return str(e)
        return "no error"

    assert "called on the loop thread" in ucx_runtime.run(nested(), timeout=10)


def test_release_stops_every_thread_it_started() -> None:
    """In a fresh process: three start/stop cycles leave no Python thread and no growing set of
    OS threads behind (UCX keeps one process-wide async thread after its first start)."""
    script = textwrap.dedent(
        f"""
        import os, threading, time
        from transfer.runtime import UcxRuntime

        base = len(os.listdir("/proc/self/task"))

        def settled_count():  # a native thread may take a moment to exit after its join
            for _ in range(100):
                n = len(os.listdir("/proc/self/task"))
                if n <= base + 1:
                    return n
                time.sleep(0.05)
            return n

        counts = []
        for _ in range(3):
            runtime = UcxRuntime.acquire({UCX_ENV!r})
            assert runtime.ucx_env == {UCX_ENV!r} and len(runtime.worker_address) > 0
            runtime.release()
            counts.append(settled_count())
        assert threading.active_count() == 1, threading.enumerate()
        assert counts == [base + 1] * 3, (base, counts)  # plus UCX's own async thread
        print("ok", counts)
        """
    )
    in_fresh_process(script)


def test_a_ucx_setting_ucx_refuses_is_named_and_leaves_no_thread() -> None:
    """In a fresh process: a misspelt UCX setting (it validates as a UCX_* name) fails the start
    with the settings named, and a later start with good ones works."""
    script = textwrap.dedent(
        f"""
        import threading
        from transfer.runtime import UcxRuntime

        try:
            UcxRuntime.acquire({{"UCX_TSL": "tcp"}})
            raise SystemExit("started")
        except RuntimeError as e:
            assert "UCX_TSL" in str(e) and "transfer.ucx_tls" in str(e), e
        assert threading.active_count() == 1, threading.enumerate()
        runtime = UcxRuntime.acquire({UCX_ENV!r})
        assert len(runtime.worker_address) > 0
        runtime.release()
        print("ok")
        """
    )
    in_fresh_process(script)


def test_default_options_yield_to_the_environment_and_to_ucx_env() -> None:
    assert context_options({}, {}) == DEFAULT_UCX_OPTIONS == {"TCP_TX_SEG_SIZE": "64k"}
    assert context_options({"UCX_TLS": "tcp"}, {}) == {"TCP_TX_SEG_SIZE": "64k", "TLS": "tcp"}
    # UCX reads the environment itself; a config_dict entry would silently override it.
    assert context_options({}, {"UCX_TCP_TX_SEG_SIZE": "8k"}) == {}
    assert context_options({"UCX_TCP_TX_SEG_SIZE": "32k"}, {}) == {"TCP_TX_SEG_SIZE": "32k"}
    # UCX refuses TX segments larger than RX ones: a smaller RX size set anywhere keeps UCX's TX.
    assert context_options({}, {"UCX_TCP_RX_SEG_SIZE": "16k"}) == {}
    assert context_options({"UCX_TCP_RX_SEG_SIZE": "16k"}, {}) == {"TCP_RX_SEG_SIZE": "16k"}


def test_a_ucx_variable_in_the_environment_wins_over_the_default() -> None:
    """In a fresh process whose environment asks for TX segments larger than UCX's RX segments
    (UCX refuses that): the start fails, so the environment reached UCX, and the error names it."""
    script = textwrap.dedent(
        f"""
        import os
        os.environ["UCX_TCP_TX_SEG_SIZE"] = "1m"
        from transfer.runtime import UcxRuntime

        try:
            UcxRuntime.acquire({UCX_ENV!r})
            raise SystemExit("started")
        except RuntimeError as e:
            assert "'UCX_TCP_TX_SEG_SIZE': '1m'" in str(e) and "environment" in str(e), e
        del os.environ["UCX_TCP_TX_SEG_SIZE"]
        runtime = UcxRuntime.acquire({UCX_ENV!r})
        assert len(runtime.worker_address) > 0
        runtime.release()
        print("ok")
        """
    )
    in_fresh_process(script)


def test_polling_progress_moves_bytes_and_is_chosen_for_gpus_only() -> None:
    assert resolve_progress_mode("auto", cuda=True) == "thread-polling"
    assert resolve_progress_mode("auto", cuda=False) == "thread"
    assert resolve_progress_mode("thread", cuda=True) == "thread"
    assert resolve_progress_mode("auto", cuda=True, direct_copy=True) == "thread"
    assert resolve_progress_mode("thread-polling", cuda=True, direct_copy=True) == "thread-polling"
    with pytest.raises(ValueError, match="progress_mode must be one of"):
        TransceiverConfig(progress_mode="polling")
    script = textwrap.dedent(
        f"""
        import numpy as np
        from transfer.runtime import UcxRuntime

        runtime = UcxRuntime.acquire({UCX_ENV!r}, None, "thread-polling")

        async def loopback():
            ep = await runtime.create_endpoint(runtime.worker_address)
            src = np.arange(1 << 20, dtype=np.uint8)
            dst = np.zeros_like(src)
            import asyncio
            recv = asyncio.ensure_future(runtime.ctx.recv(dst, tag=7))
            await ep.send(src, tag=7, force_tag=True)
            await recv
            ep.abort()
            return bool((dst == src).all())

        assert runtime.progress_mode == "thread-polling"
        assert runtime.run(loopback(), timeout=20)
        runtime.release()
        print("ok")
        """
    )
    in_fresh_process(script)


def test_closing_a_side_twice_leaves_the_runtime_to_the_other_sides() -> None:
    # A worker closed twice (or a role closed, then the whole Transceiver) released the shared
    # runtime twice, stopping it under the other side of the process.
    p, d = KVSide(specs(), seed=1), KVSide(specs(), seed=3)
    both = Transceiver(d.kv.buffers, d.specs, MODEL, config(), release=d.release)
    peer = KVSender(p.kv.buffers, p.specs, MODEL, config(), p.release)
    try:
        both.sender.close()
        both.sender.close()
        ticket = peer.publish("x", p.allocate("x", 8), 8)
        result = both.receiver.pull_blocking(ticket, d.allocate("x", 8), 0, 8)
        assert result.ok, result.error
        d.free("x")
    finally:
        both.close()
        peer.close()
    d.assert_clean()
