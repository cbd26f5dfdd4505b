"""Acceptance: LLM on the embedded SmolLM2 GGUF (float32, CPU) gives transformers' greedy tokens,
with chunked prefill, prefix reuse, batching and preemption in play."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.llm import LLM
from engine.loaders import LoadedModel
from engine.sampling_params import SamplingParams

from .conftest_engine import LONG_PROMPT, PROMPTS, SHARED_PREFIX, assert_no_leak

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

pytestmark = pytest.mark.slow


def encode(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text)


def test_greedy_batch_equals_transformers_one_prompt_at_a_time(
    smollm_llm: LLM, smollm_oracle: Callable[[list[int], int], list[int]]
) -> None:
    ids = [encode(smollm_llm, p) for p in PROMPTS]
    assert len({len(i) for i in ids}) >= 8  # prompts of many lengths
    assert (
        len(encode(smollm_llm, LONG_PROMPT)) > smollm_llm.engine.scheduler.config.prefill_chunk_size
    )
    assert (
        len(encode(smollm_llm, SHARED_PREFIX)) >= 2 * smollm_llm.engine.scheduler.config.page_size
    )
    before = smollm_llm.engine.kv.stats()
    outs = smollm_llm.generate(PROMPTS, GREEDY)
    after = smollm_llm.engine.kv.stats()
    for prompt, prompt_ids, out in zip(PROMPTS, ids, outs, strict=True):
        assert out.prompt == prompt and out.prompt_token_ids == prompt_ids
        assert out.token_ids == smollm_oracle(prompt_ids, MAX_TOKENS), prompt
        assert out.finish_reason in ("stop", "length") and out.finished
        assert out.text == smollm_llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert (
        after.reuse_hit_tokens - before.reuse_hit_tokens >= 2 * 32
    )  # the shared prefix, computed once
    assert outs[-1].metrics.num_cached_tokens >= 32
    assert_no_leak(smollm_llm.engine.kv)


def test_same_request_alone_and_in_a_batch_of_32(smollm_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    probe = "The three most important inventions in history are"
    alone = smollm_llm.generate(probe, params)[0]
    others = [f"Item {i}: a short note about the number {i * 7} and" for i in range(31)]
    batch = others[:13] + [probe] + others[13:]
    outs = smollm_llm.generate(batch, params)
    assert len(outs) == 32 and outs[13].prompt == probe
    assert outs[13].token_ids == alone.token_ids and outs[13].text == alone.text
    assert [len(o.token_ids) for o in outs] == [16] * 32
    assert_no_leak(smollm_llm.engine.kv)


def test_preemption_with_a_small_page_budget_keeps_tokens_exact(
    default_model: LoadedModel, smollm_oracle: Callable[[list[int], int], list[int]]
) -> None:
    # 12 usable pages of 16 tokens; each request ends near 3-4 pages, eight of them cannot all fit.
    llm = LLM.from_loaded(
        default_model,
        page_size=16,
        num_pages=13,
        max_num_seqs=8,
        prefill_chunk_size=64,
        max_model_len=192,  # what 12 pages hold: one longest request must fit
        max_stats_len=-1,
    )
    prompts = PROMPTS[:6] + PROMPTS[7:9]
    outs = llm.generate(prompts, GREEDY)
    preempted = sum(s.num_preempted for s in llm.engine.drain_iteration_stats())
    assert preempted > 0 and llm.engine.scheduler.num_preemptions == preempted
    assert sum(r.metrics.num_preemptions for r in llm.engine.drain_request_stats()) == preempted
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == smollm_oracle(encode(llm, prompt), MAX_TOKENS), prompt
    assert_no_leak(llm.engine.kv)


def test_chat_renders_the_template_and_keeps_conversation_order(smollm_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    conv_a = [{"role": "user", "content": "What is 2 + 2?"}]
    conv_b = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a color."},
    ]
    single = smollm_llm.chat(conv_a, params)
    both = smollm_llm.chat([conv_a, conv_b], params)
    assert len(single) == 1 and len(both) == 2
    ids_b = smollm_llm.tokenizer.encode_chat(conv_b)
    assert both[1].prompt_token_ids == ids_b
    assert both[1].token_ids == smollm_llm.generate([ids_b], params)[0].token_ids
    assert both[0].token_ids == single[0].token_ids and "4" in single[0].text
    assert_no_leak(smollm_llm.engine.kv)
