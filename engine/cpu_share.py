"""A worker process's share of the host's CPUs: torch threads for the CPUs it was given, and the
normal scheduling priority.

- Threads: torch sizes its intra-op pool from the machine's cores (or OMP_NUM_THREADS) at start. A
  worker given fewer CPUs than the host has (``resources.num_cpus``), next to other workers, the
  HTTP front end and Ray's own processes, would run more compute threads than its share, and on a
  small host their OpenMP barriers then wait for threads that another process has preempted (on
  this project's 2-core host under load, a 2-thread generate took 3-4x the CPU time of a 1-thread
  one for the same work).
- Priority: Ray starts worker processes at niceness 15 (its ``worker_niceness`` default), so that
  they yield to Ray's own daemons. A worker here is the cluster's main job; at niceness 15 any other
  process of the host at the default 0 takes nearly all of a contended core from it (the kernel
  weighs nice 0 against nice 15 about 36 to 1). The worker returns itself to 0 where the operating
  system allows that (root, or CAP_SYS_NICE); elsewhere it stays as Ray started it.
"""

from __future__ import annotations

import math
import os

import torch


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity masks on this platform (macOS)
        return max(1, os.cpu_count() or 1)


def configure_cpu_threads(num_cpus: float | None, device: str = "cpu") -> int | None:
    """On a CPU device, give this process's torch ops ``floor(num_cpus)`` threads (at least 1, at
    most the usable cores; all usable cores when None) and one inter-op thread; returns the
    intra-op count (None on other devices, where nothing changes).

    Call it once, before the first torch op of the worker (the inter-op pool is fixed then).
    """
    if torch.device(device).type != "cpu":
        return None
    cores = usable_cores()
    threads = cores if num_cpus is None else max(1, min(cores, math.floor(num_cpus)))
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)  # the engine runs one op at a time
    except RuntimeError:  # already fixed by an earlier parallel op: harmless, it stays idle
        pass
    return threads


def restore_default_priority() -> int:
    """Lower this process's niceness to 0 when it is higher and the OS allows it; returns the
    niceness it has afterwards."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except PermissionError:  # needs root or CAP_SYS_NICE: keep what Ray gave
            pass
    return os.getpriority(os.PRIO_PROCESS, 0)


def apply_cpu_share(num_cpus: float | None, device: str = "cpu") -> int | None:
    """What a worker calls once at start: its torch threads (see configure_cpu_threads) and the
    default priority. Returns the intra-op thread count (None on non-CPU devices)."""
    restore_default_priority()
    return configure_cpu_threads(num_cpus, device)
