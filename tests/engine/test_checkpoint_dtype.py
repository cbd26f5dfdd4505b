"""dtype="auto": the dtype the checkpoint holds (transformers' rule), read before any weight, and an
engine built in it whose greedy tokens are transformers' with ``dtype="auto"``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.loaders.checkpoint_dtype import checkpoint_dtype
from engine.sampling_params import SamplingParams
from tests.oracle import hf_greedy


@pytest.fixture(scope="module")
def bf16_llama3(
    tiny_hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny Llama 3 checkpoint saved again in bfloat16 (config.json then says so)."""
    from transformers import AutoModelForCausalLM

    source = tiny_hf_checkpoints["llama3"]
    out = tmp_path_factory.mktemp("bf16") / "llama3"
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for tokenizer_file in source.glob("tokenizer*"):
        shutil.copy(tokenizer_file, out / tokenizer_file.name)
    return out


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_the_dtype_comes_from_config_json_else_from_the_weights(
    tiny_hf_checkpoints: dict[str, Path], bf16_llama3: Path, tmp_path: Path
) -> None:
    assert checkpoint_dtype(str(tiny_hf_checkpoints["llama3"])) == "float32"
    assert checkpoint_dtype(str(bf16_llama3)) == "bfloat16"
    # Older checkpoints name it torch_dtype; some none at all: then the safetensors' own dtype.
    for key, value, expected in (("torch_dtype", "float16", "float16"), (None, None, "bfloat16")):
        copy = tmp_path / f"copy-{expected}"
        shutil.copytree(bf16_llama3, copy)
        config = {k: v for k, v in _config(copy).items() if k not in ("dtype", "torch_dtype")}
        if key is not None:
            config[key] = value
        (copy / "config.json").write_text(json.dumps(config))
        assert checkpoint_dtype(str(copy)) == expected
    # GGUF files load in float32 (as transformers dequantizes them), dummy weights too unless
    # their config names a dtype, or they take a checkpoint's shape.
    assert checkpoint_dtype("default") == "float32"
    assert checkpoint_dtype("llama-3-8b", "dummy") == "float32"
    assert (
        checkpoint_dtype("x", "dummy", {"model_type": "llama", "torch_dtype": "bfloat16"})
        == "bfloat16"
    )
    assert checkpoint_dtype(str(bf16_llama3), "dummy") == "bfloat16"


def test_dtype_names_as_vllm_takes_them() -> None:
    assert EngineConfig(dtype="half").dtype == "float16"
    assert EngineConfig(dtype="float").dtype == "float32"
    assert EngineConfig(dtype=torch.bfloat16).dtype == "bfloat16"
    assert EngineConfig(dtype="auto").resolved().dtype == "float32"  # the embedded GGUF
    with pytest.raises(ValueError, match="read from the checkpoint first"):
        _ = EngineConfig(dtype="auto").torch_dtype
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        EngineConfig(dtype="int8")


def test_an_auto_engine_runs_in_the_checkpoints_dtype_with_transformers_tokens(
    bf16_llama3: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(bf16_llama3), dtype="auto", num_pages=32, max_model_len=64)
    assert {p.dtype for p in llm.engine.runner.model.parameters()} == {torch.bfloat16}
    assert {llm.engine.kv.layer_cache(0)[0].dtype} == {torch.bfloat16}
    hf = AutoModelForCausalLM.from_pretrained(bf16_llama3, dtype="auto").eval()
    assert hf.dtype == torch.bfloat16
    eos = sorted(llm.engine.eos_token_ids)
    prompts = [[0, 5, 17, 42, 99, 3], [0, 7, 8, 9], [0, *range(20, 60)]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 8, eos), prompt
