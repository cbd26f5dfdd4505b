"""UcxRuntime: the process's UCX context, driven by one asyncio loop on one background thread.

ucxx is asyncio based and keeps process-global progress state per event loop, so a process runs one
loop thread and one UCX context, shared by every transceiver in it (``acquire`` counts users; the
last ``release`` shuts it down). Callers on any thread hand coroutines over with ``submit``; only
code on the loop touches UCX objects. Blocking page copies run on one copy thread (``copy``), so
they never stall the loop.

UCX endpoints are created with peer error handling, so a dead peer fails its requests instead of
hanging them, and closing an endpoint cancels every request posted on it (UCX 1.21 then leaves out
its shared-memory transports: two processes of one CPU host talk over TCP loopback).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, ClassVar, TypeVar

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

log = logging.getLogger(__name__)
T = TypeVar("T")

# UCX's TCP transport copies each send through TX segments of 8 KiB by default; 64 KiB (its RX
# default, and the most it accepts) made a 64 MiB pull 1.4-1.5x faster between two processes over
# loopback, same-run A/B (docs/benchmarks/transfer.md). Only TCP reads it; a UCX_* variable in the
# environment or in ``ucx_env`` wins, and a user who sets either segment size gets UCX's pairing.
DEFAULT_UCX_OPTIONS = {"TCP_TX_SEG_SIZE": "64k"}
_YIELDS_TO = {"TCP_TX_SEG_SIZE": ("TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE")}


class UcxRuntime:
    _shared: ClassVar[UcxRuntime | None] = None
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def acquire(
        cls,
        ucx_env: Mapping[str, str] | None = None,
        cuda_device: int | None = None,
        progress_mode: str = "thread",
    ) -> UcxRuntime:
        """The process's runtime, started on first use with ``ucx_env`` (UCX_* settings), the GPU
        whose memory it registers, and ucxx's ``progress_mode``. A later caller asking for other
        settings gets a ValueError (one UCX context per process)."""
        env = dict(ucx_env or {})
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls(env, cuda_device, progress_mode)
            elif (env and env != cls._shared.ucx_env) or (
                cuda_device is not None and cuda_device != cls._shared.cuda_device
            ):
                raise ValueError(
                    f"this process's UCX runtime already runs with {cls._shared.ucx_env} on CUDA "
                    f"device {cls._shared.cuda_device}, not {env} on {cuda_device}"
                )
            cls._shared._users += 1
            return cls._shared

    def __init__(
        self, ucx_env: dict[str, str], cuda_device: int | None, progress_mode: str
    ) -> None:
        bad = [k for k in ucx_env if not k.startswith("UCX_")]
        if bad:
            raise ValueError(f"UCX settings must be UCX_* names, got {bad}")
        if progress_mode not in ("thread", "thread-polling"):
            raise ValueError(
                f"progress_mode must be 'thread' or 'thread-polling', got {progress_mode!r}"
            )
        self.ucx_env = ucx_env
        self.cuda_device = cuda_device
        self._users = 0
        self.loop = asyncio.new_event_loop()
        self.copy_executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="duet-kv-copy"
        )
        self._thread = threading.Thread(target=self._run_loop, name="duet-ucx-loop", daemon=True)
        self._thread.start()
        try:
            self.ctx: Any = self.run(self._start_context(progress_mode), timeout=60.0)
        except Exception as e:  # a setting UCX refuses, say: no thread of ours stays behind
            self.copy_executor.shutdown(wait=False)
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
        from ucxx._lib_async import ApplicationContext, continuous_ucx_progress

        device = self.cuda_device
        if device is not None:
            # ucxx makes CUDA device 0 current on its progress thread; UCX's CUDA transports must
            # work there with the device whose memory this process registers.
            from ucxx._cuda_context import ensure_cuda_context

            continuous_ucx_progress._create_context = lambda: ensure_cuda_context(device)
        return ApplicationContext(
            config_dict=context_options(self.ucx_env, os.environ),
            progress_mode=progress_mode,
            enable_python_future=True,
        )

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop thread; safe from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for it (not from the loop thread itself)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("UcxRuntime.run called on the loop thread; await instead")
        return self.submit(coro).result(timeout)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on the loop thread soon; RuntimeError once the loop is closed."""
        self.loop.call_soon_threadsafe(fn, *args)

    async def copy(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking page copy on the copy thread and wait for it."""
        return await self.loop.run_in_executor(self.copy_executor, fn, *args)

    async def create_endpoint(self, address: bytes) -> Any:
        """A UCX endpoint to the worker at ``address`` (peer error handling on)."""
        from ucxx._lib.libucxx import UCXAddress

        return await self.ctx.create_endpoint_from_worker_address(
            UCXAddress.create_from_buffer(address), endpoint_error_handling=True
        )

    def release(self) -> None:
        """Drop one user; the last one stops UCX, the loop and both threads."""
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

        async def stop_context() -> None:
            from ucxx._lib_async.application_context import clear_progress_tasks

            self.ctx.stop_notifier_thread()
            # Else the progress thread lives as long as the loop object (ucxx keeps a reference to
            # it from a patched loop.close).
            self.ctx.worker.stop_progress_thread()
            clear_progress_tasks()
            self.ctx = None
            gc.collect()

        try:
            self.run(stop_context(), timeout=30.0)
        except Exception:
            log.exception("stopping the UCX context failed")
        self.copy_executor.shutdown(wait=True)
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
