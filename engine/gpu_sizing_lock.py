"""One engine at a time sizes its share of a GPU (``gpu_memory_utilization``).

An engine charges itself what left the GPU's free pool while it loaded outside torch's
allocator (kvcache/sizing.py non_torch_growth: CUDA libraries, NCCL), since the free pool cannot
tell whose it is. Two engines loading side by side on one GPU (cluster workers with
``resources.num_gpus`` 0.5) each saw the other's weights as their own: on one H100 the decode
worker counted 36.6 GB "held" against 16 GB of weights, found no room in its 0.425 share and did
not start. So the engines of one GPU take turns, from the first measurement to the KV cache
allocated and warmed up: each then sees only its own growth. A lock file per GPU (by its UUID,
in the temp directory the processes of a host share); the kernel drops it with its process."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)


@contextlib.contextmanager
def gpu_sizing_turn(device: str, utilization: float | None) -> Iterator[None]:
    """Hold the GPU's sizing turn while building an engine on ``device`` under
    ``utilization`` (nothing to hold on a CPU, or when sized from free memory)."""
    if torch.device(device).type != "cuda" or utilization is None:
        yield
        return
    uuid = torch.cuda.get_device_properties(torch.device(device)).uuid
    path = os.path.join(tempfile.gettempdir(), f"duet-gpu-sizing-{uuid}.lock")
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another engine on %s to size its share of the GPU", device)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
