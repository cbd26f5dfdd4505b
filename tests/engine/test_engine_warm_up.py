"""The engine's warm-up request (EngineConfig.warm_up): it runs the model, then leaves no trace."""

from __future__ import annotations

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.engine_core import LLMEngine
from engine.runner import ModelRunner
from tests.tiny_engine import TINY, greedy


def build(warm_up: bool, page_size: int = 1, device: str = "cpu") -> LLMEngine:
    # page_size 1: every token the warm-up writes fills a page, so anything it registered for
    # reuse or left held would show. Chunks of 16 tokens: on CUDA the warm-up prompt is a chunk
    # and three tokens more.
    return LLMEngine.from_config(
        EngineConfig(
            load_format="dummy",
            dummy_config=TINY,
            device=device,
            num_pages=64,
            page_size=page_size,
            max_model_len=48,
            prefill_chunk_size=16,
            reuse_policy="all_reusable",
            warm_up=warm_up,
        )
    )


GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ON_GPU = pytest.param("cuda", marks=GPU_MARKS)


@pytest.mark.parametrize(
    ("device", "steps"),
    [
        ("cpu", [(2, 1), (1, 1)]),
        # a whole chunk (no token sampled), the last three tokens over it, one decode token
        pytest.param("cuda", [(16, 0), (3, 1), (1, 1)], marks=GPU_MARKS),
    ],
)
def test_warm_up_runs_a_prefill_and_a_decode_step(
    monkeypatch: pytest.MonkeyPatch, device: str, steps: list[tuple[int, int]]
) -> None:
    batches: list[tuple[int, int]] = []
    execute = ModelRunner.execute

    def counted(self: ModelRunner, batch, sampling, *rest):  # noqa: ANN001, ANN002, ANN202
        batches.append((batch.input_ids.numel(), len(sampling)))
        return execute(self, batch, sampling, *rest)

    monkeypatch.setattr(ModelRunner, "execute", counted)
    build(warm_up=False, device=device)
    assert batches == []
    build(warm_up=True, device=device)
    assert batches == steps


@pytest.mark.parametrize("device", ["cpu", ON_GPU])
def test_a_warmed_up_engine_is_indistinguishable_from_a_cold_one(device: str) -> None:
    warm, cold = build(warm_up=True, device=device), build(warm_up=False, device=device)
    for engine in (warm, cold):
        engine.kv.check_integrity()
    assert warm.kv.stats() == cold.kv.stats()
    assert warm.kv.cached_blocks() == cold.kv.cached_blocks() == {"full": {"device": []}}
    assert warm.num_iterations == 0
    assert warm.drain_iteration_stats() == [] and warm.drain_request_stats() == []
    prompts = {"a": [0, 0, 5, 7], "b": [0, 0, 9]}  # starts like the warm-up prompt: no hit on it
    results = []
    for engine in (warm, cold):
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, greedy(6))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] = out.token_ids
        stats = engine.kv.stats()
        results.append((tokens, stats.reuse_queries, stats.reuse_hit_tokens, engine.num_iterations))
    assert results[0] == results[1]
    assert [r.request_id for r in warm.drain_request_stats()] == ["a", "b"]


def test_warm_up_needs_an_idle_engine() -> None:
    engine = build(warm_up=False, page_size=4)
    engine.add_request("a", [1, 2, 3], greedy(2))
    with pytest.raises(RuntimeError, match="idle"):
        engine.warm_up()
