"""The UCX runtime: one per process, usable from any thread, and gone without a trace on release."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tests.transfer.conftest import UCX_ENV, config
from transfer.runtime import DEFAULT_UCX_OPTIONS, UcxRuntime, context_options

pytestmark = pytest.mark.timeout(60)


def test_one_runtime_per_process_with_one_set_of_settings(ucx_runtime: UcxRuntime) -> None:
    again = UcxRuntime.acquire(UCX_ENV)
    try:
        assert again is ucx_runtime
    finally:
        again.release()
    with pytest.raises(ValueError, match="already runs with"):
        UcxRuntime.acquire({"UCX_TLS": "tcp"})
    # Settings it runs with already, some of them: the same runtime (a one-host worker's config
    # asks only UCX_NET_DEVICES=lo; the suite's runtime was refused to it)
    some = UcxRuntime.acquire({"UCX_NET_DEVICES": UCX_ENV["UCX_NET_DEVICES"]})
    try:
        assert some is ucx_runtime
    finally:
        some.release()


def test_submit_from_plain_threads_and_refuse_blocking_on_the_loop(ucx_runtime: UcxRuntime) -> None:
    async def where() -> bool:
        await asyncio.sleep(0.01)
        return threading.current_thread().name == "duet-ucx-loop"

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


def test_release_stops_every_thread_and_a_refused_setting_is_named() -> None:
    """In a fresh process: a misspelt UCX setting fails the start with the settings named and no
    thread left; then start/stop cycles leave no Python thread and no growing set of OS threads
    (UCX keeps one process-wide async thread after its first start)."""
    script = textwrap.dedent(
        f"""
        import os, threading, time
        from transfer.runtime import UcxRuntime

        try:
            UcxRuntime.acquire({{"UCX_TSL": "tcp"}})
            raise SystemExit("started")
        except RuntimeError as e:
            assert "UCX_TSL" in str(e) and "transfer.ucx_tls" in str(e), e
        assert threading.active_count() == 1, threading.enumerate()
        base = None
        counts = []
        for _ in range(2):
            runtime = UcxRuntime.acquire({UCX_ENV!r})
            assert len(runtime.worker_address) > 0
            runtime.release()
            for _ in range(100):  # a native thread may take a moment to exit after its join
                n = len(os.listdir("/proc/self/task"))
                if base is not None and n <= base:
                    break
                time.sleep(0.05)
            base = n if base is None else base
            counts.append(n)
        assert threading.active_count() == 1, threading.enumerate()
        assert counts == [counts[0]] * 2, counts
        print("ok", counts)
        """
    )
    run_script(script, timeout=50)


def test_default_options_yield_to_the_environment_and_to_ucx_env() -> None:
    assert context_options({}, {}) == DEFAULT_UCX_OPTIONS == {"TCP_TX_SEG_SIZE": "64k"}
    assert context_options({"UCX_TLS": "tcp"}, {}) == {"TCP_TX_SEG_SIZE": "64k", "TLS": "tcp"}
    # UCX reads the environment itself; a config_dict entry would silently override it.
    assert context_options({}, {"UCX_TCP_TX_SEG_SIZE": "8k"}) == {}
    assert context_options({"UCX_TCP_TX_SEG_SIZE": "32k"}, {}) == {"TCP_TX_SEG_SIZE": "32k"}
    # UCX refuses TX segments larger than RX ones: a smaller RX size set anywhere keeps UCX's TX.
    assert context_options({}, {"UCX_TCP_RX_SEG_SIZE": "16k"}) == {}
    assert context_options({"UCX_TCP_RX_SEG_SIZE": "16k"}, {}) == {"TCP_RX_SEG_SIZE": "16k"}


def test_progress_mode_polls_only_for_kv_over_ucx_on_the_loop_for_host_kv() -> None:
    assert config("ucx").ucx_progress_mode(cuda=False) == "loop"
    assert config("host_shm").ucx_progress_mode(cuda=False) == "thread"
    assert config("ucx").ucx_progress_mode(cuda=True) == "thread-polling"
    assert config("host_shm").ucx_progress_mode(cuda=True) == "thread"  # same-host reads skip UCX
    assert config("ucx", progress_mode="thread").ucx_progress_mode(cuda=True) == "thread"
    assert config("ucx", progress_mode="thread").ucx_progress_mode(cuda=False) == "thread"
    with pytest.raises(ValueError, match="progress_mode"):
        config("ucx", progress_mode="blocking")  # ucxx's: spins a core once it has seen an event


@pytest.mark.parametrize("mode", ["loop", "thread"])
def test_a_worker_loop_runs_the_transfers_with_no_thread_of_their_own(mode: str) -> None:
    """In a fresh process, as a worker actor: sender and receiver made on the worker's loop, which
    the runtime adopts (no loop thread of its own; made elsewhere it is refused). A pull awaited
    there moves the bytes over UCX and over shared memory with no copy on another thread; a
    plain thread still pulls through the loop; the loop goes on after the last release. In
    each progress mode: "loop" progresses UCX on the worker's loop, with no thread of ucxx's (no
    notifier handing completions over), polling while a pull's messages travel and not once
    while idle; "thread" has that notifier."""
    script = textwrap.dedent(
        f"""
        import asyncio, threading, time
        import torch
        from tests.transfer.conftest import MODEL, KVSide, config, specs
        from transfer import KVReceiver, KVSender
        from transfer.paths import host_shm, ucx
        from transfer.runtime import UcxRuntime

        copied_on = set()  # the threads every page copy ran on
        for module, name in ((host_shm, "copy_segments"), (ucx, "gather"), (ucx, "scatter")):
            def spy(*args, _copy=getattr(module, name)):
                copied_on.add(threading.get_ident())
                return _copy(*args)
            setattr(module, name, spy)
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        async def ident():
            return threading.get_ident()
        loop_thread = asyncio.run_coroutine_threadsafe(ident(), loop).result(10)
        try:
            UcxRuntime.acquire({UCX_ENV!r}, loop=loop)  # not on that loop
            raise SystemExit("acquired off its loop")
        except RuntimeError as e:
            assert "must be called on that loop" in str(e), e
        p, d = KVSide(specs(), seed=1), KVSide(specs(), seed=2)
        p.scramble_free_queue()  # scattered pages: UCX chunks are gathered and scattered
        d.scramble_free_queue()

        async def make(path):
            lp = asyncio.get_running_loop()
            return (
                KVSender(p.kv.buffers, p.specs, MODEL, config(path, progress_mode={mode!r}),
                         p.release, lp),
                KVReceiver(d.kv.buffers, d.specs, MODEL, config(path, progress_mode={mode!r}),
                           lp),
            )

        for path in ("ucx", "host_shm"):
            sender, receiver = asyncio.run_coroutine_threadsafe(make(path), loop).result(60)
            runtime = receiver.runtime
            assert runtime.loop is loop and sender.runtime is runtime
            names = [t.name for t in threading.enumerate()]
            assert "duet-ucx-loop" not in names, names
            assert ("UCX-Py Async Notifier Thread" in names) == ({mode!r} == "thread"), names
            progress = runtime.progress
            assert (progress is not None) == ({mode!r} == "loop")
            for i, how in enumerate(("on the loop", "from a thread")):
                rid = f"{{path}}-{{i}}"
                ticket = sender.publish(rid, p.allocate(rid, 24), 24)
                dst = d.allocate(rid, 24)
                if how == "on the loop":
                    pull = receiver.pull(ticket, dst, 0, 24)
                    result = asyncio.run_coroutine_threadsafe(pull, loop).result(60)
                else:
                    result = receiver.pull_blocking(ticket, dst, 0, 24)
                assert result.ok and result.stats.path == path, result
                assert torch.equal(d.pages_of(dst)["full"], p.pages_of(ticket.page_ids)["full"])
                d.free(rid)
            if progress is not None:
                if path == "ucx":
                    assert progress.polls > 0  # it polled while the chunks travelled
                polls, calls = progress.polls, progress.calls
                time.sleep(0.3)
                assert progress.polls == polls and progress.in_flight == 0
                # asleep when idle: a progress call per IDLE_PROGRESS_S (a spin makes thousands)
                assert progress.calls - calls < 50, progress.calls - calls
            assert copied_on == {{loop_thread}}, copied_on  # on the loop itself, no hop
            try:
                other = asyncio.new_event_loop()
                async def second():
                    return UcxRuntime.acquire({UCX_ENV!r}, loop=asyncio.get_running_loop())
                other.run_until_complete(second())
                raise SystemExit("a second loop was adopted")
            except ValueError as e:
                assert "already runs" in str(e), e
            receiver.close()
            sender.close()
            assert UcxRuntime._shared is None
        assert asyncio.run_coroutine_threadsafe(asyncio.sleep(0, "on"), loop).result(10) == "on"
        print("ok")
        """
    )
    run_script(script, timeout=50)


def test_a_runtime_started_as_another_stops_keeps_its_own_progress() -> None:
    """In a fresh process: the last user of a runtime releases it while a new runtime starts.
    ucxx's progress table is process-wide, and the old runtime's teardown cleared all of it:
    the new runtime's first endpoint then had ucxx start a polling task of its own on the new
    loop, one core spinning for good beside the runtime's own progress."""
    script = textwrap.dedent(
        f"""
        import threading
        from ucxx._lib_async.application_context import ProgressTasks
        from transfer.runtime import UcxRuntime

        first = UcxRuntime.acquire({UCX_ENV!r})
        entered, go_on = threading.Event(), threading.Event()
        real_stop = UcxRuntime._stop_context

        def held_stop(self):
            entered.set()
            assert go_on.wait(30)
            real_stop(self)

        UcxRuntime._stop_context = held_stop
        releasing = threading.Thread(target=first.release)
        releasing.start()
        assert entered.wait(30)
        UcxRuntime._stop_context = real_stop
        second = UcxRuntime.acquire({UCX_ENV!r})
        assert second is not first
        go_on.set()
        releasing.join(60)
        assert not releasing.is_alive()
        endpoint = second.run(second.create_endpoint(second.worker_address), 30)
        entry = ProgressTasks.get(second.loop)
        assert entry is second.progress, entry
        endpoint.abort()
        second.release()
        print("ok")
        """
    )
    run_script(script, timeout=100)


def run_script(script: str, timeout: float) -> None:
    """Run ``script`` in a fresh Python process from the repository root; it must exit 0 with
    a last line starting "ok"."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("ok"), done.stdout[-2000:]
