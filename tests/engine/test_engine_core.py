"""LLMEngine on the tiny random Llama-3: streaming outputs, stats, aborts, and a prefill -> decode
handoff between two engines (the disaggregated flow without the transport)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.engine_core import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

from .conftest_engine import assert_no_leak

PROMPT_A = [0, 17, 42, 99, 5, 230, 8]
PROMPT_B = [0, 300, 12, 12, 45]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def run_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    streams: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            streams.setdefault(out.request_id, []).append(out)
    return streams


def test_stream_of_outputs_and_stats(make_tiny_engine: Callable[..., LLMEngine]) -> None:
    engine = make_tiny_engine(max_stats_len=-1)
    engine.add_request("a", PROMPT_A, GREEDY)
    engine.add_request(
        "b", PROMPT_B, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    )
    streams = run_all(engine)
    for rid, n in (("a", 6), ("b", 3)):
        outs = streams[rid]
        assert len(outs) == n and [o.finished for o in outs] == [False] * (n - 1) + [True]
        final = outs[-1]
        assert [t for o in outs for t in o.delta_token_ids] == final.token_ids and len(
            final.token_ids
        ) == n
        assert "".join(o.delta_text for o in outs) == final.text
        assert final.text == engine.tokenizer.decode(final.token_ids, skip_special_tokens=True)
        assert final.finish_reason == "length" and final.metrics.num_output_tokens == n
    iters = engine.drain_iteration_stats()
    assert len(iters) == 6 and [i.iteration for i in iters] == list(range(1, 7))
    assert (iters[0].batch_size, iters[0].num_prefill_tokens, iters[0].num_decode_tokens) == (
        2,
        12,
        0,
    )
    assert (iters[1].batch_size, iters[1].num_prefill_tokens, iters[1].num_decode_tokens) == (
        2,
        0,
        2,
    )
    assert [i.num_finished for i in iters] == [0, 0, 1, 0, 0, 1]
    assert iters[0].kv.groups["full"].used == 4 and iters[-1].kv.groups["full"].used == 0
    assert all(i.step_time_s > 0 for i in iters)
    reqs = engine.drain_request_stats()
    assert [(r.request_id, r.finish_reason) for r in reqs] == [("b", "length"), ("a", "length")]
    m = reqs[1].metrics
    assert (
        m.arrival_time
        <= m.first_scheduled_time
        <= m.first_token_time
        <= m.last_token_time
        <= m.finished_time
    )
    assert engine.drain_iteration_stats() == [] and engine.drain_request_stats() == []
    assert_no_leak(engine.kv)


@pytest.mark.parametrize(("max_stats_len", "kept"), [(-1, 9), (0, 0), (4, 4)])
def test_max_stats_len(
    make_tiny_engine: Callable[..., LLMEngine], max_stats_len: int, kept: int
) -> None:
    engine = make_tiny_engine(max_stats_len=max_stats_len)
    for i in range(3):
        engine.add_request(
            f"r{i}",
            [i + 5, *PROMPT_B[1:]],
            SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        )
    run_all(engine)
    iters = engine.drain_iteration_stats()
    assert len(iters) == kept and [i.iteration for i in iters] == list(range(10 - kept, 10))
    assert len(engine.drain_request_stats()) == min(3, kept)


def test_abort_frees_and_records(make_tiny_engine: Callable[..., LLMEngine]) -> None:
    engine = make_tiny_engine(max_stats_len=-1)
    engine.add_request("a", PROMPT_A, GREEDY)
    engine.add_request("b", PROMPT_B, GREEDY)
    engine.step()
    assert (
        engine.abort_request("a")
        and not engine.abort_request("a")
        and not engine.abort_request("zzz")
    )
    outs = run_all(engine)
    assert list(outs) == ["b"]
    assert [(r.request_id, r.finish_reason) for r in engine.drain_request_stats()] == [
        ("a", "abort"),
        ("b", "length"),
    ]
    assert_no_leak(engine.kv)


def test_invalid_requests_raise_and_allocate_nothing(
    make_tiny_engine: Callable[..., LLMEngine],
) -> None:
    engine = make_tiny_engine(max_model_len=16)
    with pytest.raises(ValueError, match="request 'x': the prompt is empty"):
        engine.add_request("x", [], GREEDY)
    with pytest.raises(
        ValueError, match=r"request 'x': token id 320 is not an integer in \[0, vocab_size=320\)"
    ):
        engine.add_request("x", [1, 320], GREEDY)
    for n in (17, 16):  # (16: no room left for an output token, as vLLM refuses it)
        with pytest.raises(
            ValueError,
            match=f"request 'x': the prompt has {n} tokens; with at least one output token that "
            "is more than max_model_len=16",
        ):
            engine.add_request("x", [3] * n, GREEDY)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams, got dict"):
        engine.add_request("x", [3], {"temperature": 0})  # type: ignore[arg-type]
    assert not engine.has_unfinished()
    assert_no_leak(engine.kv)


def test_stop_strings_need_a_tokenizer() -> None:
    """A model of random weights makes no text: a stop string could never match, so it is
    refused (not accepted and ignored); stop token ids still work."""
    from tests.tiny_engine import tiny_engine

    engine = tiny_engine(16)
    assert engine.tokenizer is None
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer"):
        engine.add_request("x", [3], SamplingParams(stop=["a"]))
    engine.add_request("y", [3], SamplingParams(max_tokens=2, stop_token_ids=[5]))
    while engine.has_unfinished():
        engine.step()
    assert_no_leak(engine.kv)


def test_max_tokens_none_runs_to_the_model_length() -> None:
    from tests.tiny_engine import tiny_engine

    engine = tiny_engine(16)
    engine.add_request("z", [3, 4, 5], SamplingParams(max_tokens=None, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.finished]
    (out,) = outputs
    assert out.finish_reason == "length" and len(out.token_ids) == engine.max_model_len - 3
    assert_no_leak(engine.kv)


@pytest.mark.parametrize("seed", [None, 1234], ids=["greedy", "seeded"])
def test_prefill_engine_hands_kv_to_decode_engine(
    make_tiny_engine: Callable[..., LLMEngine], seed: int | None
) -> None:
    """P prefills (prefill-only, pages kept); the pages' bytes are copied into D's pages; D decodes.
    The tokens equal one engine doing both, greedy or sampled with a seed (D's generator skips
    the draw P's first token took). Each engine records the request's stats once: P when it hands
    the request off, D when it finishes (its gaps only between tokens it sampled)."""
    params = SamplingParams(
        temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=8, ignore_eos=True
    )
    aggregated = make_tiny_engine()
    aggregated.add_request("r", PROMPT_A, params)
    expected = run_all(aggregated)["r"][-1].token_ids

    prefill, decode = make_tiny_engine(prefill_chunk_size=3), make_tiny_engine()
    prefill.add_request("r", PROMPT_A, params, prefill_only=True)
    (first,) = run_all(prefill)["r"]
    assert not first.finished and first.token_ids == expected[:1] and not prefill.has_unfinished()
    (handed_off,) = prefill.drain_request_stats()
    assert handed_off.request_id == "r" and handed_off.finish_reason is None
    assert handed_off.metrics.num_output_tokens == 1 and handed_off.token_gaps_s == ()
    src_pages = prefill.kv.page_ids("r")["full"]

    assert decode.kv.allocate_slots("r", len(PROMPT_A))  # gen-init on D
    dst_pages = decode.kv.page_ids("r")["full"]
    decode.kv.buffers["full"][dst_pages] = prefill.kv.buffers["full"][src_pages]  # the "transfer"
    prefill.release("r")
    assert prefill.drain_request_stats() == []  # recorded once, at the handoff
    assert_no_leak(prefill.kv)

    decode.add_prefilled_request(
        "r",
        PROMPT_A,
        first.token_ids[0],
        params,
        first_text_sent=len(first.delta_text),
        num_cached_tokens=4,
    )
    outs = run_all(decode)["r"]
    assert (
        outs[0].delta_token_ids == expected[1:2]
    )  # the first token was streamed by P, not again by D
    assert outs[-1].token_ids == expected and outs[-1].finish_reason == "length"
    (done,) = decode.drain_request_stats()
    assert done.finish_reason == "length" and done.metrics.num_cached_tokens == 4
    assert done.metrics.num_output_tokens == 8 and len(done.token_gaps_s) == 6  # 7 sampled on D
    assert all(gap >= 0 for gap in done.token_gaps_s)
    assert_no_leak(decode.kv)


def test_a_prefilled_request_aborted_before_its_transfer_is_recorded_once(
    make_tiny_engine: Callable[..., LLMEngine],
) -> None:
    engine = make_tiny_engine()
    engine.add_request("r", PROMPT_A, GREEDY, prefill_only=True)
    run_all(engine)
    assert engine.abort_request("r")  # the client left before any decode worker pulled
    assert [r.finish_reason for r in engine.drain_request_stats()] == [None]
    assert_no_leak(engine.kv)


def test_an_engine_over_a_loaded_model_keeps_its_kv_cache_on_the_model_s_device(
    tiny_llama3_loaded,
) -> None:
    """The KV cache follows the model: a config naming another device (here a GPU, for a model
    in host memory) cannot split them."""
    from engine.engine_config import EngineConfig

    config = EngineConfig(model="tiny", device="cuda", page_size=4, num_pages=32, max_model_len=32)
    engine = LLMEngine.from_loaded(tiny_llama3_loaded, config)
    assert engine.kv.device.type == "cpu"
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert len(outputs[-1].token_ids) == 2
