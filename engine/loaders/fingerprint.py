"""A checkpoint's fingerprint: which weights a worker runs, in a few characters.

KV computed by one set of weights is garbage to another of the same shape: a decode worker that
pulls a prefill worker's pages (and then caches them) must run the same weights, not only a model
of the same name and shape (two fine-tunes saved as ``checkpoint-500`` on two nodes). The transfer
compatibility hash includes this fingerprint, so such peers refuse each other in the handshake.

Reading every byte of a 16 GB checkpoint would cost seconds at start; instead each weight file
contributes its name, its size and SAMPLES evenly spaced blocks of SAMPLE_BYTES (a few MB read in
all). A fine-tune changes nearly every weight, a merged LoRA every block of the layers it adapts,
so sampled blocks tell them apart; identical copies on two nodes agree. It is read from the files,
not from a rank's shard, so workers of different tensor-parallel sizes agree too. Dummy weights
are named by their shape and seed, which make them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLES = 64
SAMPLE_BYTES = 4096
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


def checkpoint_fingerprint(path: Path) -> str:
    """The fingerprint of a GGUF file or a HF checkpoint directory (its config.json and weights)."""
    h = hashlib.blake2b(digest_size=8)
    files = [path] if path.is_file() else sorted(_checkpoint_files(path))
    for file in files:
        size = file.stat().st_size
        h.update(f"{file.name}:{size}\n".encode())
        with file.open("rb") as f:
            if file.suffix not in _WEIGHT_SUFFIXES or size <= SAMPLES * SAMPLE_BYTES:
                h.update(f.read())
                continue
            step = (size - SAMPLE_BYTES) // (SAMPLES - 1)
            for i in range(SAMPLES):
                f.seek(i * step)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def dummy_fingerprint(config: object, seed: int) -> str:
    """Random weights: the shape (a ModelConfig's repr) and the seed that drew them."""
    return hashlib.blake2b(f"dummy:{config!r}:{seed}".encode(), digest_size=8).hexdigest()


def _checkpoint_files(directory: Path) -> list[Path]:
    found = [p for p in directory.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES]
    return [directory / "config.json", *found]
