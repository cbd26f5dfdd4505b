"""HF checkpoint directories: config.json and (possibly sharded) *.safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.model_config import ModelConfig
from engine.tp.partition import TPPartition
from engine.tp.shard_weights import hf_shard


def read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def config_from_hf_dir(directory: Path) -> ModelConfig:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json")
    return ModelConfig.from_hf_config(read_json(config_path))


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files: those named by model.safetensors.index.json when sharded, else every *.safetensors."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index)["weight_map"].values()))
        files = [directory / name for name in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{directory} has no *.safetensors weights (other weight formats are not supported)"
        )
    return files


def iter_safetensors_weights(
    directory: Path, part: TPPartition | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of every shard, read one at a time (memory stays at one
    tensor); with ``part`` only the tensor-parallel rank's slice of each split tensor is read."""
    for path in safetensors_files(directory):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if part is None:
                    yield name, f.get_tensor(name)
                    continue
                sliced = f.get_slice(name)
                cut = hf_shard(name, tuple(sliced.get_shape()), part)
                if cut is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, start, stop = cut
                index = (slice(None),) * dim + (slice(start, stop),)
                yield name, sliced[index]
