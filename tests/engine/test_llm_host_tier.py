"""Acceptance: the KV host tier through engine.LLM on the embedded SmolLM2 (float32).

A multi-turn workload whose first turns together exceed the device pool but fit host memory: the
second turn of the first conversations finds its prefix in the host tier (asserted from the
stats), and its tokens equal those of the same run without a tier, and transformers'. On a GPU,
the same with pinned host memory and the copy streams (tier on vs off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.llm import LLM
from engine.loaders import LoadedModel
from engine.sampling_params import SamplingParams

from .conftest_engine import SHARED_PREFIX, assert_no_leak

pytestmark = pytest.mark.slow

TURN_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=TURN_TOKENS)  # stops at EOS, as the oracle
TOPICS = ["volcanoes", "the moon", "honey bees", "glaciers", "printing presses"]
DEVICE_PAGES = 25  # 24 usable pages of 16 tokens: about three conversations' first turns
HOST_PAGES = 64


def first_turns(llm: LLM) -> list[list[int]]:
    """Five conversations of about 130 tokens each: two shared pages (SHARED_PREFIX), then six
    of their own, so 32 full pages together against 24 on the device."""
    tokenizer = llm.tokenizer
    assert tokenizer is not None
    texts = [
        f"{SHARED_PREFIX}Tell me, in a few sentences, the story of {topic}: how people came to "
        f"know about {topic}, who first wrote about {topic} and why, what changed once more "
        f"people understood {topic}, which questions about {topic} are still open today, and one "
        f"fact about {topic} that most readers find surprising. Keep the tone light and friendly, "
        f"avoid jargon about {topic}, and end with a short question about {topic} for the reader "
        f"to think about after reading your answer."
        for topic in TOPICS
    ]
    return [tokenizer.encode(t) for t in texts]


def conversation(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """Both turns, one conversation at a time (turn 2 = turn 1 + its answer + a follow-up);
    returns each turn's prompts and answers."""
    tokenizer = llm.tokenizer
    assert tokenizer is not None
    follow_up = tokenizer.encode(" Now say it again, shorter.", add_special_tokens=False)
    prompts1 = first_turns(llm)
    answers1 = [o.token_ids for o in llm.generate(prompts1, GREEDY)]
    prompts2 = [p + a + follow_up for p, a in zip(prompts1, answers1, strict=True)]
    answers2 = [llm.generate([p], GREEDY)[0].token_ids for p in prompts2]
    return prompts1 + prompts2, answers1 + answers2


def make_llm(loaded: LoadedModel, host_pages: int, **kwargs: Any) -> LLM:
    page_bytes = loaded.config.num_layers * 2 * 16 * loaded.config.num_kv_heads
    page_bytes *= loaded.config.head_dim * 4
    return LLM.from_loaded(
        loaded,
        page_size=16,
        num_pages=DEVICE_PAGES,
        max_model_len=256,
        prefill_chunk_size=64,
        max_num_batched_tokens=256,
        host_tier_bytes=host_pages * page_bytes,
        **kwargs,
    )


def test_second_turns_hit_the_host_tier_and_keep_their_tokens(
    default_model: LoadedModel, smollm_oracle: Callable[[list[int], int], list[int]]
) -> None:
    with_tier = make_llm(default_model, HOST_PAGES)
    without = make_llm(default_model, 0)
    prompts, answers = conversation(with_tier)
    stats = with_tier.engine.kv.stats()
    host = stats.groups["full"].host
    assert host is not None and host.total == HOST_PAGES
    # The first turns overflowed the device pool: their pages went to host, and the second turns
    # of the first conversations were served from there.
    assert host.offloaded >= 4 and host.loaded_back >= 4 and host.drops == 0
    # The tier counts every load-back; the reuse counters one query per request, so a preempted
    # request's loads on its re-admission count only in the tier's (vLLM leaves them out too).
    assert 0 < stats.reuse_host_hit_tokens <= host.hit_tokens
    assert_no_leak(with_tier.engine.kv)
    seconds = with_tier.engine.drain_request_stats()[-len(TOPICS) :]
    host_tokens = [r.metrics.num_cached_host_tokens for r in seconds]
    # (turn 1 may hit host too: a request preempted when the pool ran short comes back later)
    assert sum(host_tokens) <= stats.reuse_host_hit_tokens
    assert sum(t >= 64 for t in host_tokens) >= 3  # most second turns: 4+ pages from host
    assert all(r.metrics.num_cached_tokens >= 112 for r in seconds)  # every second turn: 7 pages

    off_prompts, off_answers = conversation(without)
    assert off_prompts == prompts and off_answers == answers
    assert without.engine.kv.stats().groups["full"].host is None
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer == smollm_oracle(prompt, TURN_TOKENS)


def test_a_host_tier_smaller_than_one_page_is_refused(default_model: LoadedModel) -> None:
    with pytest.raises(
        ValueError,
        match=r"host tier \(host_tier_bytes 1000 B\) holds less than one page in some pool group",
    ):
        LLM.from_loaded(default_model, page_size=16, num_pages=20, max_model_len=64,
                        host_tier_bytes=1000)  # fmt: skip
    with pytest.raises(ValueError, match="needs prefix reuse"):
        LLM.from_loaded(default_model, page_size=16, num_pages=20, max_model_len=64,
                        host_tier_bytes=1 << 24, reuse_policy="none")  # fmt: skip


# A random-weight Llama for the GPU test (the embedded SmolLM2 is not on the GPU machines).
GPU_DUMMY = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}


def id_conversation(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """conversation() in token ids: five first turns of 130 tokens (two shared pages, then their
    own), then each turn 1 + its answer + a follow-up."""
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(1, 512, (32,), generator=gen).tolist()
    prompts1 = [shared + torch.randint(1, 512, (98,), generator=gen).tolist() for _ in TOPICS]
    params = SamplingParams(temperature=0.0, max_tokens=TURN_TOKENS, ignore_eos=True)
    answers1 = [o.token_ids for o in llm.generate(prompts1, params)]
    prompts2 = [p + a + [7, 8, 9] for p, a in zip(prompts1, answers1, strict=True)]
    answers2 = [llm.generate([p], params)[0].token_ids for p in prompts2]
    return prompts1 + prompts2, answers1 + answers2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_host_tier_pinned_copies_keep_the_tokens() -> None:
    """Offloads on their own stream, load-backs awaited by the scheduler (CUDA graphs on, the
    default): tokens equal tier off."""
    from engine.loaders import load_model

    loaded = load_model("gpu-dummy", "dummy", torch.float32, "cuda", dummy_config=GPU_DUMMY)
    with_tier = make_llm(loaded, HOST_PAGES)
    tier = with_tier.engine.kv.host_tier
    assert tier is not None and tier.buffers["full"].is_pinned()
    without = make_llm(loaded, 0)
    prompts, answers = id_conversation(with_tier)
    host = with_tier.engine.kv.stats().groups["full"].host
    assert host is not None and host.loaded_back >= 4 and host.pinned == 0
    assert id_conversation(without) == (prompts, answers)
    assert_no_leak(with_tier.engine.kv)
