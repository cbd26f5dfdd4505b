"""Host KV pools faulted in ahead of use, in the background (Linux 5.14+, MADV_POPULATE_WRITE).

A host pool is a zeroed memfd mapping (kv_buffer.shared_zeros) whose pages the kernel takes when
first written, one 4 KiB fault at a time. Pages hold every layer of a token range (737 KiB a page
for the embedded model), so a request's first use of a page faults ~180 times in store_kv, and the
page allocator hands out pages nobody has written until the whole pool has been used once: a
1 GiB pool of the embedded model, 32 requests of 128 prompt tokens a round, spent 0.4-0.55 s of
each round's two 2048-token prefill steps in those faults (43 thousand a round) for the first
six rounds, 0.06 s once every page had been written (engine.LLM, 2 threads, this 2-core VM).

MADV_POPULATE_WRITE maps the pages writable without writing them, so it is safe while the engine
writes K/V into the same pool: contents never change. A daemon thread does it in 8 MiB calls
(ctypes releases the GIL during each), from the first page up, as the allocator hands pages out.
The thread runs under SCHED_IDLE: populating costs 0.7-3.7 s of kernel time per GiB on this VM,
which would otherwise be taken from an engine that starts computing at once
(scripts/bench_offline.py, a fresh 1 GiB engine per run: 165-174 tokens/s with the thread at
normal priority, 215-245 under SCHED_IDLE); idle, it only uses cores the engine leaves free, and
the engine's own first writes fault in whatever it has not reached yet.
A pool larger than the memory the host reports available is left to fault in lazily: taking it
all at start could push the host into reclaim, where a lazily used pool might never need it.
``DUET_PREFAULT_KV=0`` leaves every pool lazy. (An idle-priority thread preempted inside a call
holds its process's memory-map lock for reading, so the process's own mmap/munmap wait until the
thread runs again; that is bounded by the scheduler's minimal share for idle threads, and the
opt-out is there for hosts where it is not.)
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import threading
import weakref

import torch

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h
CHUNK = 8 << 20
PAGE = 4096


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


_exiting = threading.Event()
_threads: weakref.WeakSet[Prefaulter] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    """Stop every populating thread at its next chunk and wait for it (one 8 MiB call), before
    the interpreter shuts down. A daemon thread still running then is ended inside whatever it
    runs next: when the main thread has already dropped the pool, that is the pool's release in
    torch's C++ on this thread, and the process aborted ("terminate called without an active
    exception", in about one exit of three of `duet run-default`)."""
    _exiting.set()
    for thread in list(_threads):
        thread.join(timeout=10.0)


class Prefaulter(threading.Thread):
    """Populates one host tensor's mapping, then ends. ``populated_bytes`` says how far it got.

    It holds the tensor only during each call (a weak reference between them): an engine dropped
    while its pool is still being populated frees the pool, and the thread stops at its next
    chunk, rather than keeping the memory and spending idle time on it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(name="kv-prefault", daemon=True)
        self.tensor = weakref.ref(tensor)
        storage = tensor.untyped_storage()
        self.start_address, self.nbytes = storage.data_ptr(), storage.nbytes()
        self.populated_bytes = 0
        self.idle = False  # whether the thread got the idle scheduling policy

    def run(self) -> None:
        try:  # pid 0: this thread (Linux schedules threads one by one)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            self.idle = True
        except (AttributeError, OSError):  # no SCHED_IDLE here: populate at normal priority
            pass
        aligned = (self.start_address + PAGE - 1) // PAGE * PAGE
        end = self.start_address + self.nbytes
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for at in range(aligned, end, CHUNK):
            held = self.tensor()  # keeps the mapping valid during this call
            if held is None or _exiting.is_set():
                return
            length = min(CHUNK, end - at)
            failed = madvise(at, length, MADV_POPULATE_WRITE) != 0
            del held
            if failed:
                # EINVAL before Linux 5.14; ENOMEM when the host ran short: the rest faults lazily.
                log.info("KV pool left to fault in lazily (errno %d)", ctypes.get_errno())
                return
            self.populated_bytes += length


def prefault(tensor: torch.Tensor) -> Prefaulter | None:
    """Start populating a host pool's pages in the background; None where it is not done (not a
    CPU tensor, empty, or larger than the memory available now)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    if os.environ.get("DUET_PREFAULT_KV", "1") == "0":
        return None
    available = available_bytes()
    nbytes = tensor.untyped_storage().nbytes()
    if available is None or nbytes > available:
        log.info("KV pool of %d bytes left to fault in lazily (available: %s)", nbytes, available)
        return None
    thread = Prefaulter(tensor)
    _threads.add(thread)
    thread.start()
    return thread
