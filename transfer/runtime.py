"""UcxRuntime: the process's UCX context, driven by one asyncio loop on one background thread.

ucxx is asyncio based and keeps process-global progress state per event loop, so a process runs one
loop thread and one UCX context, shared by every transceiver in it (``UcxRuntime.acquire`` counts
users; the last ``release`` shuts it down). Callers on any thread (plain threads, Ray actors, sync
or async) hand coroutines over with ``submit``; only code on the loop touches UCX objects.

UCX endpoints are created with peer error handling, so a dead peer fails its requests instead of
hanging them, and closing an endpoint cancels every request posted on it. (In UCX 1.21 that mode
excludes the shared-memory transports, so two processes of one CPU host talk over TCP loopback.)
Unless the process's environment or ``ucx_env`` says otherwise, TCP sends copy out through 64 KiB
segments instead of UCX's 8 KiB (``DEFAULT_UCX_OPTIONS``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, ClassVar, TypeVar

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

log = logging.getLogger(__name__)
T = TypeVar("T")

# UCX's TCP transport copies each send through TX segments, 8 KiB by default: every rendezvous
# fragment then costs a syscall and a progress step per 8 KiB. 64 KiB (UCX's RX segment default;
# larger TX segments are refused) moved 2-3x the bytes per second between two processes over
# loopback, for raw ucxx messages and staged chunks alike (docs/benchmarks/transfer.md, fifteenth
# pass). Only TCP reads it; a UCX_* variable in the environment or in ``ucx_env`` wins.
DEFAULT_UCX_OPTIONS = {"TCP_TX_SEG_SIZE": "64k"}
# A default steps aside when the user sets any of these (UCX refuses TX segments larger than RX).
_DEFAULT_YIELDS_TO = {"TCP_TX_SEG_SIZE": ("TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE")}


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
        """The process's runtime, started on first use with the UCX_* settings ``ucx_env`` (and, for
        KV on a GPU, that GPU's index) and ucxx ``progress_mode`` ("thread" or "thread-polling";
        later callers share the first one's). A later caller asking for other settings gets a
        ValueError (one UCX context per process)."""
        env = dict(ucx_env or {})
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls(env, cuda_device, progress_mode)
            elif (env and env != cls._shared.ucx_env) or (
                cuda_device is not None and cuda_device != cls._shared.cuda_device
            ):
                raise ValueError(
                    f"this process's UCX runtime already runs with {cls._shared.ucx_env} on CUDA device "
                    f"{cls._shared.cuda_device}, not {env} on {cuda_device}"
                )
            cls._shared._users += 1
            return cls._shared

    def __init__(
        self, ucx_env: dict[str, str], cuda_device: int | None = None, progress_mode: str = "thread"
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
        self.progress_mode = progress_mode
        self._users = 0
        self.loop = asyncio.new_event_loop()
        # Page copies block until done (staging.py); one thread keeps them off the loop.
        self.copy_executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="duet-kv-copy"
        )
        self._thread = threading.Thread(target=self._run_loop, name="duet-ucx-loop", daemon=True)
        self._thread.start()
        try:
            self.ctx: Any = self.run(self._start_context(), timeout=60.0)
        except Exception as e:  # a UCX setting UCX refuses, say: no thread of ours stays behind
            self.copy_executor.shutdown(wait=False)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10.0)
            from_environ = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
            raise RuntimeError(
                f"the UCX context did not start with the settings {ucx_env or '(none)'} "
                f"(transfer.ucx_tls, ucx_net_devices, ucx_env) and {from_environ} from the "
                f"environment: {e!r}"
            ) from e
        self.worker_address: bytes = bytes(self.ctx.worker_address)
        self._iov: Any = False  # (``iov``: False until first asked)
        self._iov_lock = threading.Lock()
        # A contiguous send at least this long went by rendezvous (PeerLink.piece_sends_ok).
        self.rendezvous_bytes = rendezvous_bytes(ucx_env, os.environ)

    @property
    def iov(self) -> Any:
        """Piece-list messages on this worker (transfer/ucp_iov.py); None, logged once, where
        UCP cannot give them (then host pages are staged, as on GPUs)."""
        with self._iov_lock:
            if self._iov is False:
                from transfer.ucp_iov import IovOps

                try:
                    self._iov = IovOps(self.ctx.worker.handle)
                except Exception as e:  # an unexpected libucp: the staged path still works
                    log.warning("UCX IOV messages unavailable (%s); host pages are staged", e)
                    self._iov = None
            return self._iov

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _start_context(self) -> Any:
        from ucxx._lib_async import ApplicationContext, continuous_ucx_progress

        device = self.cuda_device
        if device is not None:
            # ucxx makes CUDA device 0 current on its progress thread; UCX's CUDA transports must
            # work there with the device whose memory this process registers.
            from ucxx._cuda_context import ensure_cuda_context

            continuous_ucx_progress._create_context = lambda: ensure_cuda_context(device)
        options = context_options(self.ucx_env, os.environ)
        # UCX progresses on its own thread and wakes waiters through the notifier thread (python
        # futures); "thread" sleeps when idle, "thread-polling" spins (lower latency per message).
        return ApplicationContext(
            config_dict=options, progress_mode=self.progress_mode, enable_python_future=True
        )

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop thread; safe from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Any, *args: Any) -> None:
        """Run the plain function ``fn(*args)`` on the loop thread soon; safe from any thread, and
        cheaper than ``submit`` (no task, no future). Raises RuntimeError once the loop is closed."""
        self.loop.call_soon_threadsafe(fn, *args)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for it (not from the loop thread itself)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "UcxRuntime.run called on the loop thread; await the coroutine instead"
            )
        return self.submit(coro).result(timeout)

    def on_loop(self) -> bool:
        return threading.current_thread() is self._thread

    async def copy(self, fn: Any, *args: Any) -> Any:
        """Run a blocking page copy (or another blocking device call) on the copy thread, wait for
        it and return its result."""
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
            if self._users <= 0:  # a release without its acquire: stopping twice would break
                log.error("UcxRuntime.release without a matching acquire ignored")
                return
            self._users -= 1
            if self._users > 0:
                return
            if cls._shared is self:
                cls._shared = None
        self._shutdown()

    def _shutdown(self) -> None:
        async def stop_context() -> None:
            from ucxx._lib_async.application_context import clear_progress_tasks

            if self._iov:
                self._iov.close()
            self.ctx.stop_notifier_thread()
            # The progress thread would otherwise live as long as the loop object (ucxx keeps a
            # reference to it from a patched loop.close).
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


def cuda_index(buffers: Mapping[str, Any]) -> int | None:
    """The CUDA device index of the KV storage tensors, None on CPU."""
    device = next(iter(buffers.values())).device
    if device.type != "cuda":
        return None
    if device.index is None:
        import torch

        return torch.cuda.current_device()
    return device.index


def context_options(ucx_env: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The ``config_dict`` of the UCX context: ``ucx_env`` without its ``UCX_`` prefixes, over
    ``DEFAULT_UCX_OPTIONS`` whose settings (or the settings they must agree with) neither it nor
    ``environ`` sets (UCX reads the environment itself; a config_dict entry would override it)."""
    ours = {k.removeprefix("UCX_"): v for k, v in ucx_env.items()}
    options = {
        k: v
        for k, v in DEFAULT_UCX_OPTIONS.items()
        if not any(n in ours or f"UCX_{n}" in environ for n in _DEFAULT_YIELDS_TO[k])
    }
    options.update(ours)
    return options


RENDEZVOUS_PROOF_BYTES = 256 << 10  # above UCX's automatic rendezvous threshold on every transport
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "g": 1 << 30,
}


def rendezvous_bytes(ucx_env: Mapping[str, str], environ: Mapping[str, str]) -> int | None:
    """A message size UCX surely sends by rendezvous with these settings (``UCX_RNDV_THRESH``
    from ``ucx_env`` or the environment, else its automatic threshold), or None when the setting
    is one this cannot read (then nothing is known to be a rendezvous)."""
    value = context_options(ucx_env, environ).get("RNDV_THRESH", environ.get("UCX_RNDV_THRESH"))
    if value is None or value.strip().lower() == "auto":
        return RENDEZVOUS_PROOF_BYTES
    text = value.strip().lower()
    digits = text.rstrip("bkmg")
    unit = text[len(digits) :]
    if not digits.isdigit() or unit not in _SIZE_UNITS:
        return None
    return max(RENDEZVOUS_PROOF_BYTES, int(digits) * _SIZE_UNITS[unit] + 1)
