"""A HF checkpoint's tokenizer encodes and decodes as transformers' AutoTokenizer does where
transformers departs from tokenizer.json: LlamaTokenizer's rebuilt pipeline (``legacy``,
``add_prefix_space``) and the tokens tokenizer_config.json's ``added_tokens_decoder`` adds."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, processors, trainers

from engine.loaders.hf import config_from_hf_dir
from engine.loaders.hf_tokenizer import tokenizer_from_hf_dir

transformers = pytest.importorskip("transformers")

CORPUS = [
    "[INST] Hello world [/INST] Sure, here is the answer.",
    "Hello there, how are you?  Fine:\n\n- one\n- two 2024",
    "<<SYS>> You are kind. <</SYS>> naïve café 你好",
]
TEXTS = [
    "Hello world",
    " Hello world",
    "  two leading spaces",
    "<s>[INST] Hello world [/INST]",
    "[INST] Hi [/INST] Sure</s><s>[INST] again [/INST]",
    "line one\nline two\n\n  indented",
    "naïve café 你好 ☃",
    "",
]


def _llama2_style(directory: Path, tokenizer_config: dict) -> Path:
    """A Llama-2-style tokenizer.json (a normalizer prepending "▁" to every segment, byte
    fallback, BOS by the post-processor), as Llama 2 and Mistral 7B v0.x ship, small."""
    tok = BackendTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens]
    )
    tok.train_from_iterator(CORPUS * 50, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": 256,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config))
    base = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(base | tokenizer_config))
    return directory


def _assert_same(directory: Path, texts: tuple[str, ...] = ()) -> None:
    ours = tokenizer_from_hf_dir(directory, config_from_hf_dir(directory))
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert ours is not None
    for text in [*TEXTS, *texts]:
        for special in (True, False):
            assert ours.encode(text, special) == hf.encode(text, add_special_tokens=special), (
                text,
                special,
            )
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize(
    "tokenizer_config",
    [
        {"tokenizer_class": "LlamaTokenizer", "legacy": False},
        {"tokenizer_class": "LlamaTokenizer", "legacy": True},
        {"tokenizer_class": "LlamaTokenizerFast"},  # (legacy unset: the class's False)
        {"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_prefix_space": False},
        {"tokenizer_class": "PreTrainedTokenizerFast"},  # the file as written
    ],
    ids=["legacy-false", "legacy-true", "legacy-unset", "no-prefix-space", "file-as-written"],
)
def test_llama2_style_files_encode_and_decode_as_transformers(
    tmp_path: Path, tokenizer_config: dict
) -> None:
    _assert_same(_llama2_style(tmp_path / "tok", tokenizer_config))


def test_llama_class_reads_the_text_after_a_special_token_as_transformers(tmp_path: Path) -> None:
    """The case that differed: "<s>[INST]" is "[" ... with legacy false, "▁[" ... in the file."""
    directory = _llama2_style(tmp_path / "tok", {"tokenizer_class": "LlamaTokenizer"})
    ours = tokenizer_from_hf_dir(directory, config_from_hf_dir(directory))
    assert ours is not None
    ids = ours.encode("<s>[INST] Hi", False)
    assert ours.id_to_token(ids[0]) == "<s>"
    assert not ours.id_to_token(ids[1]).startswith("▁")


def test_added_tokens_decoder_adds_and_marks_tokens(tmp_path: Path) -> None:
    """A token only tokenizer_config.json lists is added at its id; one tokenizer.json holds as
    an ordinary token but the config calls special is skipped as special."""
    directory = _llama2_style(tmp_path / "tok", {"tokenizer_class": "PreTrainedTokenizerFast"})
    held = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
    size = held.get_vocab_size()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    flags = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    config["added_tokens_decoder"] = {
        str(size): {"content": "<tool_call>", "special": True, **flags},
        str(size + 1): {"content": "<|plain|>", "special": False, **flags},
        "1": {"content": "<s>", "special": True, **flags},
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours = tokenizer_from_hf_dir(directory, config_from_hf_dir(directory))
    assert ours is not None
    text = "a <tool_call> b <|plain|>"
    assert {size, size + 1} <= set(ours.encode(text, False))
    assert ours.decode([size], skip_special_tokens=True) == ""
    _assert_same(directory, (text, "<tool_call><tool_call>x"))
