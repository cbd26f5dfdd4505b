"""HFTokenizerView (``LLM.get_tokenizer()``) called as vLLM users call transformers' tokenizer:
each call gives what transformers' own load of the embedded GGUF gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.hf_tokenizer_view import HFTokenizerView
from engine.loaders import LoadedModel

TEXTS = ["The capital of France is", " spaces  and\nnewlines", "émoji 🙂 ünïcode"]
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
]


@pytest.fixture(scope="module")
def tok(default_model: LoadedModel) -> HFTokenizerView:
    assert default_model.tokenizer is not None
    return HFTokenizerView(default_model.tokenizer)


def test_text_and_ids_as_transformers(tok: HFTokenizerView, hf_gguf_tokenizer: Any) -> None:
    hf = hf_gguf_tokenizer
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == hf.encode(
                text, add_special_tokens=special
            )
        assert tok(text).input_ids == hf(text)["input_ids"]
        assert tok(text)["attention_mask"] == hf(text)["attention_mask"]
        ids = hf.encode(text)
        assert tok.decode(ids) == hf.decode(ids)
        assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        pieces = hf.convert_ids_to_tokens(ids)
        assert tok.convert_tokens_to_ids(pieces) == hf.convert_tokens_to_ids(pieces)
    batch = [hf.encode(t) for t in TEXTS]
    assert tok(TEXTS).input_ids == hf(TEXTS)["input_ids"]
    assert tok.batch_decode(batch, skip_special_tokens=True) == hf.batch_decode(
        batch, skip_special_tokens=True
    )
    assert tok.decode(batch[0][1]) == hf.decode(batch[0][1])  # one id


def test_chat_template_with_transformers_defaults(
    tok: HFTokenizerView, hf_gguf_tokenizer: Any
) -> None:
    hf = hf_gguf_tokenizer
    # vLLM users' idiom, and the bare call (transformers: no generation prompt, ids)
    assert tok.apply_chat_template(
        CONV, tokenize=False, add_generation_prompt=True
    ) == hf.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(CONV).input_ids == hf.apply_chat_template(CONV)["input_ids"]
    assert tok.apply_chat_template(CONV, return_dict=False) == hf.apply_chat_template(
        CONV, return_dict=False
    )
    assert tok.apply_chat_template([CONV, CONV[1:]], tokenize=False) == hf.apply_chat_template(
        [CONV, CONV[1:]], tokenize=False
    )


def test_vocabulary_and_special_tokens(tok: HFTokenizerView, hf_gguf_tokenizer: Any) -> None:
    hf = hf_gguf_tokenizer
    assert tok.get_vocab() == hf.get_vocab()
    assert (len(tok), tok.vocab_size) == (len(hf), hf.vocab_size)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(tok, name) == getattr(hf, name), name
        assert getattr(tok, name + "_id") == getattr(hf, name + "_id"), name
    assert set(tok.all_special_ids) == set(hf.all_special_ids)
    assert tok.chat_template == hf.chat_template


def test_options_that_ask_for_what_it_lacks_are_refused(tok: HFTokenizerView) -> None:
    assert tok("a", padding=False, truncation=None, return_tensors=None).input_ids == tok.encode(
        "a"
    )
    with pytest.raises(ValueError, match="return_tensors"):
        tok("a", return_tensors="pt")


def test_an_hf_checkpoints_tokenizer_as_transformers_loads_it(
    tiny_llama3_loaded: LoadedModel, tiny_llama3_dir: Path
) -> None:
    """A Llama 3 tokenizer.json (BOS added by its post-processor, 256 reserved special tokens)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_llama3_dir)
    assert tiny_llama3_loaded.tokenizer is not None
    tok = HFTokenizerView(tiny_llama3_loaded.tokenizer)
    assert tok(TEXTS).input_ids == hf(TEXTS)["input_ids"]
    assert set(tok.all_special_ids) == set(hf.all_special_ids)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    assert tok.apply_chat_template(
        CONV, add_generation_prompt=True, return_dict=False
    ) == hf.apply_chat_template(CONV, add_generation_prompt=True, return_dict=False)
