"""engine/loaders/fingerprint.py: a checkpoint's fingerprint names its weights. Copies agree
wherever they lie; another set of weights of the same shape and size (a fine-tune) does not."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from engine.loaders.fingerprint import SAMPLE_BYTES, SAMPLES, checkpoint_fingerprint


def _checkpoint(root: Path, weights: bytes) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(weights)
    return root


def test_copies_agree_and_other_weights_of_the_same_size_do_not(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    weights = rng.integers(0, 256, 8 * SAMPLES * SAMPLE_BYTES, dtype=np.uint8)
    tuned = weights + rng.integers(0, 2, weights.size, dtype=np.uint8)  # every block moved
    base = _checkpoint(tmp_path / "checkpoint-500", weights.tobytes())
    copy = tmp_path / "elsewhere"
    shutil.copytree(base, copy)
    other = _checkpoint(tmp_path / "other", tuned.tobytes())
    assert checkpoint_fingerprint(base) == checkpoint_fingerprint(copy)
    assert checkpoint_fingerprint(other) != checkpoint_fingerprint(base)
    (copy / "config.json").write_text('{"model_type": "mistral"}')  # (small files: every byte)
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(base)


def test_a_gguf_file_is_fingerprinted_by_its_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    weights = rng.integers(0, 256, 8 * SAMPLES * SAMPLE_BYTES, dtype=np.uint8)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, twin, tuned = tmp_path / "m.gguf", tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    first.write_bytes(weights.tobytes())
    twin.write_bytes(weights.tobytes())
    tuned.write_bytes((weights ^ 1).tobytes())
    assert checkpoint_fingerprint(twin) == checkpoint_fingerprint(first)
    assert checkpoint_fingerprint(tuned) != checkpoint_fingerprint(first)
