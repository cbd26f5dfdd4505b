"""Acceptance: LLM(max_stats_len=-1 | 0 | N) buffers iteration and request stats as promised."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.loaders import LoadedModel
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPTS = [[0, 7, 8], [1, 9, 10, 11], [2, 12]]  # distinct first tokens: admitted together


@pytest.mark.parametrize(
    ("max_stats_len", "iterations", "requests"), [(-1, 5, 3), (0, 0, 0), (2, 2, 2)]
)
def test_stats_buffers(
    tiny_llama3_loaded: LoadedModel, max_stats_len: int, iterations: int, requests: int
) -> None:
    llm = LLM.from_loaded(
        tiny_llama3_loaded, page_size=4, num_pages=16, max_model_len=60, max_stats_len=max_stats_len
    )
    llm.generate(PROMPTS, PARAMS)  # one prefill step, then 4 decode steps
    iters = llm.engine.drain_iteration_stats()
    reqs = llm.engine.drain_request_stats()
    assert [i.iteration for i in iters] == list(range(6 - iterations, 6))  # the last N, in order
    assert len(reqs) == requests
    if max_stats_len == -1:
        assert [(i.batch_size, i.num_prefill_tokens, i.num_decode_tokens) for i in iters] == [
            (3, 9, 0)
        ] + [(3, 0, 3)] * 4
        assert [i.num_finished for i in iters] == [0, 0, 0, 0, 3]
        # vLLM's ids, which scripts written for it sort outputs by: int(out.request_id)
        assert sorted(r.request_id for r in reqs) == ["0", "1", "2"]
        assert all(r.finish_reason == "length" and r.metrics.num_output_tokens == 5 for r in reqs)
    assert llm.engine.drain_iteration_stats() == [] and llm.engine.drain_request_stats() == []
