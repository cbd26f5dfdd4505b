"""UcxRuntime: the process's UCX context and the one asyncio loop every transfer of the process runs
on.

ucxx is asyncio based and keeps process-global progress state per event loop, so a process runs one
loop and one UCX context, shared by every transceiver in it (``acquire`` counts users; the last
``release`` shuts it down). The loop is the owner's when it says so (``acquire(loop=...)``: a
worker actor's own loop, so that its pulls, their control messages and their copies run where the
worker awaits them, with no hop through another thread), else one on a background thread of its
own. Callers on other threads hand coroutines over with ``submit``; only code on the loop touches
UCX objects. UCX itself is progressed on that loop too (progress.py; progress_mode "loop", the
default for host KV over UCX), or by ucxx's progress thread ("thread", "thread-polling"). Copies of
host memory run on the loop itself (``copy``); copies that wait for a GPU stream run on one copy
thread, so the loop never waits for a device.

UCX endpoints are created with peer error handling, so a dead peer fails its requests instead of
hanging them, and closing an endpoint cancels every request posted on it (UCX 1.21 then leaves out
its shared-memory transports: two processes of one CPU host talk over TCP loopback).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from transfer.config import PROGRESS_MODES
from transfer.progress import LoopProgress

if TYPE_CHECKING:
    import torch

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

log = logging.getLogger(__name__)
T = TypeVar("T")

# UCX's TCP transport copies each send through TX segments of 8 KiB by default; 64 KiB (its RX
# default, and the most it accepts) made a 64 MiB pull 1.4-1.5x faster between two processes over
# loopback, same-run A/B (docs/benchmarks/transfer.md). Only TCP reads it; a UCX_* variable in the
# environment or in ``ucx_env`` wins, and a user who sets either segment size gets UCX's pairing.
DEFAULT_UCX_OPTIONS = {"TCP_TX_SEG_SIZE": "64k"}
UCXX_MODES = tuple(m for m in PROGRESS_MODES if m != "auto")  # ("auto" is the config's choice)
_YIELDS_TO = {"TCP_TX_SEG_SIZE": ("TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE")}


class UcxRuntime:
    _shared: ClassVar[UcxRuntime | None] = None
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def acquire(
        cls,
        ucx_env: Mapping[str, str] | None = None,
        cuda_device: int | None = None,
        progress_mode: str = "loop",
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> UcxRuntime:
        """The process's runtime, started on first use with ``ucx_env`` (UCX_* settings), the GPU
        whose memory it registers, ucxx's ``progress_mode``, and the event loop to run on: the
        caller's running ``loop`` (called on it), or None for a loop thread of its own. A later
        caller asking for settings the runtime lacks (a UCX_* value it does not run with, another
        GPU or loop) gets a ValueError (one UCX context per process)."""
        env = dict(ucx_env or {})
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls(env, cuda_device, progress_mode, loop)
            elif (
                not env.items() <= cls._shared.ucx_env.items()
                or (cuda_device is not None and cuda_device != cls._shared.cuda_device)
                or (loop is not None and loop is not cls._shared.loop)
            ):
                raise ValueError(
                    f"this process's UCX runtime already runs with {cls._shared.ucx_env} on CUDA "
                    f"device {cls._shared.cuda_device} on its loop {cls._shared.loop}, not {env} "
                    f"on {cuda_device} on {loop}"
                )
            cls._shared._users += 1
            return cls._shared

    def __init__(
        self,
        ucx_env: dict[str, str],
        cuda_device: int | None,
        progress_mode: str,
        loop: asyncio.AbstractEventLoop | None,
    ) -> None:
        bad = [k for k in ucx_env if not k.startswith("UCX_")]
        if bad:
            raise ValueError(f"UCX settings must be UCX_* names, got {bad}")
        if progress_mode not in UCXX_MODES:
            raise ValueError(f"progress_mode must be one of {UCXX_MODES}, got {progress_mode!r}")
        self.ucx_env = ucx_env
        self.cuda_device = cuda_device
        self.progress: LoopProgress | None = None  # progress_mode "loop": UCX progressed there
        self._users = 0
        self.copy_executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="duet-kv-copy"
        )
        self._thread: threading.Thread | None = None  # the loop's, when it is our own
        if loop is not None:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                raise RuntimeError("UcxRuntime.acquire(loop=...) must be called on that loop")
            self.loop = loop
            self._loop_thread_id = threading.get_ident()
        else:
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._run_loop, name="duet-ucx-loop", daemon=True
            )
            self._thread.start()
            self._loop_thread_id = self._thread.ident
        try:
            if self._thread is None:
                self.ctx: Any = self._make_context(progress_mode)
            else:
                self.ctx = self.run(self._start_context(progress_mode), timeout=60.0)
        except Exception as e:  # a setting UCX refuses, say: no thread of ours stays behind
            self.copy_executor.shutdown(wait=False)
            if self._thread is not None:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout=10.0)
            environ = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
            raise RuntimeError(
                f"the UCX context did not start with the settings {ucx_env or '(none)'} "
                f"(transfer.ucx_tls, ucx_net_devices, ucx_env) and {environ} from the "
                f"environment: {e!r}"
            ) from e
        self.worker_address: bytes = bytes(self.ctx.worker_address)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _start_context(self, progress_mode: str) -> Any:
        return self._make_context(progress_mode)

    def _make_context(self, progress_mode: str) -> Any:
        """The ucxx context, bound to the running loop (ours: called on it)."""
        from ucxx._lib_async import ApplicationContext, continuous_ucx_progress

        device = self.cuda_device
        if device is not None:
            # ucxx makes CUDA device 0 current on its progress thread; UCX's CUDA transports must
            # work there with the device whose memory this process registers.
            from ucxx._cuda_context import ensure_cuda_context

            continuous_ucx_progress._create_context = lambda: ensure_cuda_context(device)

        def make(mode: str) -> Any:
            # Only a progress thread needs futures (its notifier thread sets them on the loop);
            # on the loop, a message's waiter sees its completion itself.
            return ApplicationContext(
                config_dict=context_options(self.ucx_env, os.environ),
                progress_mode=mode,
                enable_python_future=mode.startswith("thread"),
            )

        from ucxx._lib_async.application_context import ProgressTasks

        if progress_mode == "loop":
            ctx, self.progress = LoopProgress.take_over(make, self.loop)
        else:
            ctx = make(progress_mode)
        self._progress_entry = ProgressTasks[self.loop]  # (see create_endpoint)
        return ctx

    def messages(self) -> contextlib.AbstractContextManager[None]:
        """Around each data message's send or receive: progressed on the loop, UCX is polled
        until it ends (LoopProgress.messages); with ucxx's thread, nothing to do."""
        return self.progress.messages() if self.progress is not None else contextlib.nullcontext()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop thread; safe from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for it (not from the loop thread itself)."""
        if self.on_loop():
            coro.close()
            raise RuntimeError("UcxRuntime.run called on the loop thread; await instead")
        return self.submit(coro).result(timeout)

    def on_loop(self) -> bool:
        """Whether the caller runs on the runtime's loop thread."""
        return threading.get_ident() == self._loop_thread_id

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on the loop thread soon; RuntimeError once the loop is closed."""
        self.loop.call_soon_threadsafe(fn, *args)

    async def copy(self, device: torch.device, fn: Callable[..., T], *args: Any) -> T:
        """Run a page copy ``fn(*args)`` between buffers on ``device`` and wait for it.

        Host memory: right here on the loop. It is bounded CPU work that torch runs without the
        GIL, and a hop to a thread and back costs two wake-ups per copy. Same run, paired, a
        pull awaited on another loop with copies on the copy thread (as before) / on the
        runtime's loop with copies there: host_shm 1.13-1.31 at 1 MiB, 1.03-1.14 at 16 MiB,
        1.01-1.06 at 64 MiB; ucx 1.04-1.22 (two runs of 15 repetitions, load 3-7;
        docs/benchmarks/transfer.md). On a GPU the copy waits for a stream: on the copy thread,
        so the loop never waits for the device."""
        if device.type == "cpu":
            return fn(*args)
        return await self.off_loop(fn, *args)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking work (a GPU copy's wait, opening a peer's pools) on the copy thread."""
        return await self.loop.run_in_executor(self.copy_executor, fn, *args)

    async def create_endpoint(self, address: bytes) -> Any:
        """A UCX endpoint to the worker at ``address`` (peer error handling on)."""
        from ucxx._lib.libucxx import UCXAddress
        from ucxx._lib_async.application_context import ProgressTasks

        # ucxx keeps one process-wide table of each loop's progress, and clears all of it when
        # any context goes (its finalizer): a runtime released as this one started left this
        # loop without an entry, and ucxx then started a polling task of its own here, one core
        # spinning for good. Ours is put back first.
        ProgressTasks.setdefault(self.loop, self._progress_entry)
        return await self.ctx.create_endpoint_from_worker_address(
            UCXAddress.create_from_buffer(address), endpoint_error_handling=True
        )

    async def _stop_context_async(self) -> None:
        self._stop_context()

    def _stop_context(self) -> None:
        from ucxx._lib_async.application_context import ProgressTasks

        if self.progress is not None:
            self.progress.stop()
        self.ctx.stop_notifier_thread()
        # Else the progress thread lives as long as the loop object (ucxx keeps a reference to
        # it from a patched loop.close).
        self.ctx.worker.stop_progress_thread()
        if ProgressTasks.get(self.loop) is self._progress_entry:  # (only ours: not the table)
            del ProgressTasks[self.loop]
        self.ctx = None
        gc.collect()

    def release(self) -> None:
        """Drop one user; the last one stops UCX, and the loop and its thread when they are ours."""
        cls = type(self)
        with cls._lock:
            if self._users <= 0:
                log.error("UcxRuntime.release without a matching acquire ignored")
                return
            self._users -= 1
            if self._users > 0:
                return
            if cls._shared is self:
                cls._shared = None

        try:
            if self.on_loop():
                self._stop_context()
            else:
                self.run(self._stop_context_async(), timeout=30.0)
        except Exception:
            log.exception("stopping the UCX context failed")
        self.copy_executor.shutdown(wait=True)
        if self._thread is None:  # the owner's loop goes on
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30.0)
        if not self._thread.is_alive():
            self.loop.close()


def context_options(ucx_env: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The UCX context's ``config_dict``: ``ucx_env`` without its ``UCX_`` prefixes, over the
    defaults that neither it nor ``environ`` overrides (UCX reads the environment itself; a
    config_dict entry would win over it)."""
    ours = {k.removeprefix("UCX_"): v for k, v in ucx_env.items()}
    options = {
        k: v
        for k, v in DEFAULT_UCX_OPTIONS.items()
        if not any(n in ours or f"UCX_{n}" in environ for n in _YIELDS_TO[k])
    }
    options.update(ours)
    return options
