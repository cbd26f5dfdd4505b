"""Fixtures shared by every package's tests: the embedded model, our load of it, and transformers'
load of the same GGUF (the correctness oracle). Session-scoped: transformers needs ~15 s per load."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.loaders import LoadedModel, default_gguf_path, load_model

# Ray and UCX in tests: loopback only, and quiet. Ray rewrites "127.0.0.1" in a cluster address to
# this host's external IP unless it believes it runs without a cluster network; this variable (read
# when ray is imported, so it must be set here, before any test module imports ray) keeps every
# connection of the tests, and of the Ray processes they start, on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# Host KV pools fault in lazily in the tests (kvcache/prefault.py): each test cluster's workers
# would populate pools of up to 256 MiB that the test barely uses, while they load and start
# (tests/cluster/test_cluster_local.py: 152 s with it, 132 s without, same hour). The prefault's
# own tests turn it back on.
os.environ.setdefault("DUET_PREFAULT_KV", "0")


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF file."""
    return default_gguf_path()


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """Our load of the embedded GGUF in float32 on CPU (shared: do not modify its weights)."""
    return load_model("default")


@pytest.fixture(scope="session")
def hf_gguf_model(gguf_path: Path) -> Any:
    """transformers' own load of the embedded GGUF (the oracle), float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
