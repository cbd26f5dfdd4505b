"""Stop strings through the real incremental detokenizer (a tiny word-level tokenizer)."""

from __future__ import annotations

import pytest
import tokenizers

from engine.detokenizer import IncrementalDetokenizer
from engine.loaders import LoadedModel
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

from .conftest_engine import assert_no_leak, run_step, tiny_kv, tiny_scheduler

WORDS = ["<eos>", "hello", "world", "stop", "here", "x"]


@pytest.fixture(scope="module")
def word_tokenizer() -> Tokenizer:
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="x")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<eos>"])
    return Tokenizer(backend, eos_token="<eos>")


def generate(
    tok: Tokenizer, words: list[str], **params: object
) -> tuple[Request, list[RequestOutput]]:
    """Run one request whose model 'says' ``words`` in order; return it and its stream of outputs."""
    return generate_ids(tok, [WORDS.index(w) for w in words], frozenset({0}), **params)


def generate_ids(
    tok: Tokenizer, ids: list[int], eos: frozenset[int], **params: object
) -> tuple[Request, list[RequestOutput]]:
    """Run one request whose model 'says' the token ``ids`` in order."""
    kv = tiny_kv()
    sched = tiny_scheduler(kv)
    sp = SamplingParams(temperature=0.0, max_tokens=len(ids), **params)  # type: ignore[arg-type]
    prompt = [ids[0]]
    req = Request(
        "r",
        prompt,
        sp,
        eos_token_ids=eos,
        eos_token_id=tok.eos_token_id,
        detokenizer=IncrementalDetokenizer(tok, prompt, sp.skip_special_tokens),
    )
    sched.add_request(req)
    stream: list[RequestOutput] = []
    while sched.has_unfinished():
        _, changed = run_step(sched, lambda r: ids[r.num_output_tokens])
        stream += [RequestOutput.from_request(r) for r in changed]
    assert_no_leak(kv)
    return req, stream


@pytest.mark.parametrize("end", ["max_tokens", "eos"])
def test_a_stop_string_in_the_tail_released_at_the_end_stops_the_text(
    default_model: LoadedModel, end: str
) -> None:
    """The last token is a space and half of a character ('Ġæ' of " 日"): its text is held back
    until the character completes, and the request ends first. The stop string "User: " in that
    tail ends the text as any stop string does (it was streamed, finish reason 'length')."""
    tok = default_model.tokenizer
    assert tok is not None
    ids = tok.encode("\nUser: \u65e5\u672c", add_special_tokens=False)[:4]  # \n User : ' 日'[:1]
    if end == "eos":
        ids.append(tok.eos_token_id)
    req, stream = generate_ids(tok, ids, frozenset({tok.eos_token_id}), stop=["User: "])
    assert (req.finish_reason, req.stop_reason) == ("stop", "User: ")
    assert req.output_text == "".join(o.delta_text for o in stream) == "\n"


def test_stop_string_is_removed_from_the_text(word_tokenizer: Tokenizer) -> None:
    req, stream = generate(
        word_tokenizer, ["hello", "world", "stop", "hello", "hello"], stop=["stop"]
    )
    assert req.finish_reason == "stop" and req.stop_reason == "stop"
    assert req.output_token_ids == [1, 2, 3]  # the token completing the stop string is kept
    assert req.output_text == " hello world "
    assert "".join(o.delta_text for o in stream) == " hello world "
    assert all("stop" not in o.delta_text for o in stream)


def test_stop_string_kept_when_asked(word_tokenizer: Tokenizer) -> None:
    req, _ = generate(
        word_tokenizer,
        ["hello", "world", "stop", "hello"],
        stop=["world st", "hello"],
        include_stop_str_in_output=True,
    )
    assert (
        req.stop_reason == "hello" and req.output_text == " hello" and req.output_token_ids == [1]
    )


def test_a_kept_stop_string_holds_no_text_back(word_tokenizer: Tokenizer) -> None:
    """With include_stop_str_in_output, no streamed text can be taken back (the text ends after
    the stop string, past all that was sent), so none is held back, as in vLLM: each token's text
    streams at once."""
    words = ["hello", "world", "hello", "stop", "here"]
    _, stream = generate(word_tokenizer, words, stop=["stop here"], include_stop_str_in_output=True)
    assert [o.delta_text for o in stream] == [f" {w}" for w in words]
    _, held = generate(word_tokenizer, words, stop=["stop here"])
    assert held[0].delta_text == ""  # (without it, the last 8 characters wait)


def test_of_stop_strings_one_token_completes_the_first_to_complete_wins(
    word_tokenizer: Tokenizer,
) -> None:
    """vLLM 0.32's rule: the text is what one character at a time would have stopped at ("r"
    completes inside " world" before "world" does); a tie goes to the first listed."""
    for include, text in ((False, " hello wo"), (True, " hello wor")):
        req, _ = generate(
            word_tokenizer,
            ["hello", "world", "here"],
            stop=["world", "r"],
            include_stop_str_in_output=include,
        )
        assert (req.stop_reason, req.output_text) == ("r", text)
    req, _ = generate(word_tokenizer, ["hello", "world"], stop=["rld", "orld"])
    assert (req.stop_reason, req.output_text) == ("rld", " hello wo")


def test_a_stop_string_matches_only_once_more_than_min_tokens_are_generated(
    word_tokenizer: Tokenizer,
) -> None:
    """vLLM's rule: text made while at most min_tokens tokens exist is not searched again."""
    words = ["hello", "stop", "world", "stop", "here"]
    req, _ = generate(word_tokenizer, words, stop=["stop"])
    assert (req.output_text, len(req.output_token_ids)) == (" hello ", 2)
    req, _ = generate(word_tokenizer, words, stop=["stop"], min_tokens=3)
    assert (req.output_text, req.stop_reason, len(req.output_token_ids)) == (
        " hello stop world ",
        "stop",
        4,
    )


def test_stop_string_spanning_tokens_and_earliest_match_wins(word_tokenizer: Tokenizer) -> None:
    req, _ = generate(
        word_tokenizer, ["hello", "world", "stop", "here"], stop=["stop here", "ld st"]
    )
    assert (
        req.stop_reason == "ld st"
        and req.output_text == " hello wor"
        and req.output_token_ids == [1, 2, 3]
    )


def test_eos_adds_no_text_and_stops(word_tokenizer: Tokenizer) -> None:
    req, stream = generate(word_tokenizer, ["hello", "<eos>", "world"])
    assert req.finish_reason == "stop" and req.stop_reason is None
    assert req.output_text == " hello" and req.output_token_ids == [1, 0] and stream[-1].finished
    req, _ = generate(
        word_tokenizer, ["hello", "<eos>", "world"], skip_special_tokens=False, ignore_eos=True
    )
    assert req.output_text == " hello <eos> world" and req.finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
def test_a_token_that_stops_by_its_id_adds_its_text_only_when_asked(
    word_tokenizer: Tokenizer, include: bool
) -> None:
    """As vLLM: a stop token's (or a shown EOS's) text is left out of the text unless
    include_stop_str_in_output, as a stop string's is."""
    words = ["hello", "stop", "world"]
    req, stream = generate(
        word_tokenizer, words, stop_token_ids=[3], include_stop_str_in_output=include
    )
    assert req.finish_reason == "stop" and req.stop_reason == 3 and req.output_token_ids == [1, 3]
    want = " hello stop" if include else " hello"
    assert req.output_text == want == "".join(o.delta_text for o in stream)
    req, _ = generate(
        word_tokenizer,
        ["hello", "<eos>"],
        skip_special_tokens=False,
        include_stop_str_in_output=include,
    )
    assert req.output_text == (" hello <eos>" if include else " hello")


def test_another_eos_id_stops_naming_its_id_as_vllm(word_tokenizer: Tokenizer) -> None:
    """An EOS id other than the tokenizer's (generation_config's end-of-turn ids) stops as a stop
    token does in vLLM: stop_reason is its id, its text left out; the tokenizer's EOS has none."""
    eos = frozenset({word_tokenizer.eos_token_id, 4})  # "here" (id 4) as a second EOS
    req, _ = generate_ids(word_tokenizer, [1, 4, 2], eos)
    assert (req.finish_reason, req.stop_reason, req.output_text) == ("stop", 4, " hello")
    req, _ = generate_ids(word_tokenizer, [1, 1, 0, 2], eos)
    assert (req.finish_reason, req.stop_reason) == ("stop", None)
    req, _ = generate_ids(word_tokenizer, [1, 1, 4, 2], eos, ignore_eos=True)
    assert (req.finish_reason, req.stop_reason) == ("length", None)


def test_streamed_deltas_add_up_to_the_text(word_tokenizer: Tokenizer) -> None:
    req, stream = generate(word_tokenizer, ["hello", "world", "hello", "world"], stop=["never"])
    assert [o.delta_token_ids for o in stream] == [[1], [2], [1], [2]]
    assert "".join(o.delta_text for o in stream) == req.output_text == " hello world hello world"
    assert stream[0].delta_text == " h"  # "never" is 5 long: 4 characters held back until the end
