"""HF checkpoint directories: single file and sharded safetensors, tokenizer files, dtype."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from engine.loaders import load_model

from .conftest import TINY_HF_CONFIGS, write_tiny_checkpoint


def test_sharded_checkpoint_loads_the_same_weights(
    tiny_hf_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    # Same config and seed as the session fixture's "qwen3" (seed 1), saved in several shards.
    sharded = write_tiny_checkpoint(
        tmp_path / "sharded", TINY_HF_CONFIGS["qwen3"], seed=1, max_shard_size="40KB"
    )
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    one_file = load_model(str(tiny_hf_checkpoints["qwen3"]))
    loaded = load_model(str(sharded), load_format="hf")
    assert loaded.config == one_file.config
    for (n1, p1), (n2, p2) in zip(
        loaded.model.named_parameters(), one_file.model.named_parameters(), strict=True
    ):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_name_config_and_stop_ids(tiny_llama3_dir: Path) -> None:
    loaded = load_model(str(tiny_llama3_dir), dtype=torch.bfloat16)
    assert loaded.name == "llama3"
    assert loaded.config.eos_token_ids == (1, 4) and loaded.config.bos_token_id == 0
    assert (
        loaded.config.rope_scaling is not None and loaded.config.rope_scaling.rope_type == "llama3"
    )
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.tokenizer is not None and loaded.tokenizer.stop_token_ids == (1, 4)


def test_chat_template_file_wins_and_tokenizer_is_optional(
    tiny_llama3_dir: Path, tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(tiny_llama3_dir, tmp_path / "copy"))
    (copy / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    tok = load_model(str(copy)).tokenizer
    assert tok is not None and tok.apply_chat_template([{"role": "user", "content": "a"}]) == "[a]"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (copy / name).unlink()
    assert load_model(str(copy)).tokenizer is None
