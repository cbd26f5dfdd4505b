"""IncrementalDetokenizer: token-by-token deltas over multi-byte text and special tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from engine.loaders import LoadedModel
from engine.tokenizer import Tokenizer


def _tok(model: LoadedModel) -> Tokenizer:
    assert model.tokenizer is not None
    return model.tokenizer


def test_multibyte_characters_wait_until_complete(default_model: LoadedModel) -> None:
    tok = _tok(default_model)
    text = "héllo 日本語 😀"
    ids = tok.encode(text)
    # Byte-level BPE cuts 日, 語 and 😀 across tokens (the tokenizer tests check these ids against transformers).
    assert [tok.id_to_token(i) for i in ids] == [
        "h",
        "Ã©",
        "llo",
        "Ġæ",
        "Ĺ",
        "¥",
        "æľ¬",
        "è",
        "ª",
        "ŀ",
        "ĠðŁĺ",
        "Ģ",
    ]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert deltas == ["h", "é", "llo", "", "", " 日", "本", "", "", "語", "", " 😀"]
    assert detok.finish() == ""
    assert detok.text == text and detok.token_ids == ids


def test_mixed_text_concatenates_to_full_decode(default_model: LoadedModel) -> None:
    tok = _tok(default_model)
    for text in ["Grüße 👍🏽🇫🇷 and 👩‍💻 write 中文字符 fast.", "한국어 ΕΛΛΗΝΙΚΑ\n\t 1234 ✓"]:
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok)
        deltas = [detok.add(i) for i in ids]
        assert all(REPLACEMENT_CHAR not in d for d in deltas)
        assert "".join(deltas) + detok.finish() == tok.decode(ids) == text


def test_special_tokens_skipped_or_kept(default_model: LoadedModel) -> None:
    tok = _tok(default_model)
    ids = tok.encode("<|im_start|>assistant\nÇa va? 😀<|im_end|>")
    skipping = IncrementalDetokenizer(tok, skip_special_tokens=True)
    assert skipping.add_many(ids) + skipping.finish() == "assistant\nÇa va? 😀"
    keeping = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert keeping.add_many(ids) + keeping.finish() == "<|im_start|>assistant\nÇa va? 😀<|im_end|>"


def test_prompt_gives_left_context(default_model: LoadedModel) -> None:
    tok = _tok(default_model)
    prompt = tok.encode("The answer is")
    generated = tok.encode(" 日本 😀 yes")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert detok.add_many(generated) + detok.finish() == " 日本 😀 yes"
    assert detok.token_ids == generated


def test_incomplete_character_is_released_by_finish(default_model: LoadedModel) -> None:
    tok = _tok(default_model)
    first_piece = tok.encode(" 😀")[0]  # "ĠðŁĺ": a space and three of the emoji's four bytes
    detok = IncrementalDetokenizer(tok)
    assert detok.add(first_piece) == ""
    assert detok.finish() == tok.decode([first_piece]) == " " + REPLACEMENT_CHAR


def test_a_character_the_prompt_began_goes_out_whole(default_model: LoadedModel) -> None:
    """A prompt that ends inside a character (a client sending back prompt + output cut mid-
    emoji): the generated tokens that complete it give the whole character, as vLLM's stream
    does. It was lost: the completed character took the place of the prompt's U+FFFD, the text
    grew no longer, and the next delta started after it."""
    tok = _tok(default_model)
    ids = tok.encode("Hello 日本語 ok")
    split = [tok.id_to_token(i) for i in ids].index("Ĺ")  # ("Ġæ", "Ĺ", "¥": " 日"'s bytes)
    for cut in (split, split + 1):  # (the prompt holds one or two of 日's three bytes)
        detok = IncrementalDetokenizer(tok, prompt_ids=ids[:cut])
        deltas = [detok.add(i) for i in ids[cut:]] + [detok.finish()]
        assert "".join(deltas) == "日本語 ok", deltas
    # a prompt ending in a broken character that nothing completes: not said again
    detok = IncrementalDetokenizer(tok, prompt_ids=ids[:split])
    assert detok.add_many(tok.encode(" ok")) + detok.finish() == " ok"


# Ids of byte-level tokens that are (parts of) multi-byte characters, mixed with ordinary words.
_PIECES = st.sampled_from(
    [179, 120, 248, 241, 115, 40303, 218, 17097, 40993, 2756, 88, 31394, 905, 216, 198, 1, 2]
)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(_PIECES, max_size=24))
def test_random_streams_concatenate_to_decode(default_model: LoadedModel, ids: list[int]) -> None:
    tok = _tok(default_model)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        deltas = [detok.add(i) for i in ids]
        assert all(not d.endswith(REPLACEMENT_CHAR) for d in deltas)
        assert "".join(deltas) + detok.finish() == tok.decode(ids, skip_special_tokens=skip)


def _byte_fallback_tokenizer() -> Tokenizer:
    """Gemma's kind of tokenizer: pieces, and <0xNN> byte tokens for what they lack (emoji, most
    accented letters), decoded by Replace + ByteFallback + Fuse."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as Backend

    pieces = ["▁", "▁Hi", "Hi", "▁and", "and", "▁a", "a", "b", "!"]
    vocab = [("<pad>", 0.0), ("<eos>", 0.0), ("<bos>", 0.0), ("<unk>", 0.0)]
    vocab += [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    vocab += [(p, -1.0 - 0.1 * i) for i, p in enumerate(pieces)]
    backend = Backend(models.Unigram(vocab, unk_id=3, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in ("<pad>", "<eos>", "<bos>", "<unk>")
        ]
    )
    return Tokenizer(backend, bos_token="<bos>", eos_token="<eos>")


def test_a_prompt_ending_in_byte_tokens_leaves_the_generated_text_whole() -> None:
    """The prompt's left context must start at a character: five tokens back would start inside
    the emoji's bytes here, and the byte-fallback decoder then made every byte token of the run,
    the generated "ü" included, into U+FFFD (as neither transformers nor vLLM do)."""
    tok = _byte_fallback_tokenizer()
    prompt = tok.encode("Hi 👍🏽")
    full = tok.encode("Hi 👍🏽ü and 😀!")
    assert full[: len(prompt)] == prompt and len(prompt) > 5  # (8 byte tokens after "Hi")
    generated = full[len(prompt) :]
    detok = IncrementalDetokenizer(tok, prompt)
    text = detok.add_many(generated) + detok.finish()
    assert text == tok.decode(generated) == "ü and 😀!"


def _spaced_tokenizer() -> Tokenizer:
    """Words and two added special tokens, without a decoder: tokenizers then joins every token
    with a space, special ones included (as WordPiece's decoder does)."""
    import tokenizers

    words = ["<s>", "<sep>", "hello", "world"]
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="hello")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<s>", "<sep>"])
    return Tokenizer(backend, bos_token="<s>")


def _text(tok: Tokenizer, ids: list[int], skip: bool, spaces: bool) -> str:
    detok = IncrementalDetokenizer(tok, [2], skip, spaces)  # prompt: "hello"
    return detok.add_many(ids) + detok.finish()


def test_spaces_between_special_tokens_as_vllm_writes_them() -> None:
    """vLLM's fast detokenizer: with special tokens kept and spaces_between_special_tokens=False,
    an added token right after another generated one comes without the decoder's space.
    transformers' fast decode takes the flag and ignores it, so it is the oracle of True only."""
    from transformers import PreTrainedTokenizerFast

    tok = _spaced_tokenizer()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    ids = [0, 1, 1, 3, 1]  # <s> <sep> <sep> world <sep>
    assert _text(tok, ids, skip=False, spaces=True) == " " + hf.decode(ids)
    assert _text(tok, ids, skip=False, spaces=True) == " <s> <sep> <sep> world <sep>"
    assert _text(tok, ids, skip=False, spaces=False) == " <s><sep><sep> world <sep>"
    for spaces in (True, False):  # skipped special tokens leave nothing to space
        assert _text(tok, ids, skip=True, spaces=spaces) == " " + hf.decode(
            ids, skip_special_tokens=True
        )


def test_spaces_between_special_tokens_change_nothing_for_byte_level_bpe(
    default_model: LoadedModel, hf_gguf_tokenizer: object
) -> None:
    """Byte-level BPE puts no space between added tokens: both values give transformers' text."""
    tok = _tok(default_model)
    ids = [1, 2, 1, *tok.encode("The cat"), 2, 2, 0]  # <|im_start|> <|im_end|> ... <|endoftext|>
    expected = hf_gguf_tokenizer.decode(ids, skip_special_tokens=False)  # type: ignore[attr-defined]
    for spaces in (True, False):
        detok = IncrementalDetokenizer(tok, (), False, spaces)
        assert detok.add_many(ids) + detok.finish() == expected
