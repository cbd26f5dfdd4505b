"""ModelRunner over scheduler + batch builder + paged KV: chunking and decoding see the same context
as one full prefill (the tiny random Llama-3 checkpoint, float32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.batch_builder import BatchBuilder
from engine.kv_setup import kv_pool_templates
from engine.loaders import LoadedModel
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.scheduler_config import SchedulerConfig
from kvcache.manager import KVCacheManager

from .conftest_engine import make_request

PROMPTS = [[0, 17, 42, 99, 5, 230, 8, 61, 77, 3, 150], [0, 300, 12, 12, 45]]


def run(
    loaded: LoadedModel, prompts: list[list[int]], chunk: int, steps: int
) -> list[list[torch.Tensor]]:
    """Logits of every sampled row, per request, over ``steps`` engine steps (greedy tokens)."""
    (spec,) = kv_pool_templates(loaded.config, 4, torch.float32)
    spec = dataclasses.replace(spec, num_pages=40)
    kv = KVCacheManager([spec], "none")
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, prefill_chunk_size=chunk, page_size=4), kv
    )
    builder = BatchBuilder(4, sched.config.max_pages_per_seq)
    runner = ModelRunner(loaded.model, kv, loaded.config.num_layers, Sampler())
    reqs = [make_request(f"r{i}", p, max_tokens=50) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    logits_of: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
    for _ in range(steps):
        out = sched.schedule()
        builder.release(out.released_ids)
        batch = builder.build(out)
        sampling = [r for r, s in zip(out.requests, out.sample, strict=True) if s]
        logits = runner.compute_logits(batch)
        for r, row in zip(sampling, logits, strict=True):
            logits_of[r.request_id].append(row)
        sched.update(out, logits.argmax(-1).tolist())
    for r in reqs:
        sched.abort(r.request_id)
    kv.check_integrity()
    return [logits_of[r.request_id] for r in reqs]


def test_chunked_prefill_and_decode_match_a_single_prefill(tiny_llama3_loaded: LoadedModel) -> None:
    whole = run(tiny_llama3_loaded, PROMPTS, chunk=64, steps=4)  # prefill, then 3 decodes
    chunked = run(tiny_llama3_loaded, PROMPTS, chunk=3, steps=7)  # 4 chunks for the long prompt
    for a, b in zip(whole, chunked, strict=True):
        assert len(a) == 4 and len(b) >= 4  # the short prompt finishes its chunks sooner
        for x, y in zip(a, b, strict=False):
            assert torch.allclose(x, y, atol=1e-4, rtol=1e-4)
    # decode logits of step k equal a fresh prefill of the prompt plus the k tokens sampled so far
    tokens = [int(row.argmax()) for row in whole[0]]
    extended = PROMPTS[0] + tokens[:3]
    (fresh,) = run(tiny_llama3_loaded, [extended], chunk=64, steps=1)
    assert torch.allclose(fresh[0], whole[0][3], atol=1e-4, rtol=1e-4)


def test_runner_samples_one_token_per_sampled_row(tiny_llama3_loaded: LoadedModel) -> None:
    (spec,) = kv_pool_templates(tiny_llama3_loaded.config, 4, torch.float32)
    kv = KVCacheManager([dataclasses.replace(spec, num_pages=8)], "none")
    sched = Scheduler(SchedulerConfig(page_size=4), kv)
    runner = ModelRunner(
        tiny_llama3_loaded.model, kv, tiny_llama3_loaded.config.num_layers, Sampler()
    )
    req = make_request("r", PROMPTS[1])
    sched.add_request(req)
    out = sched.schedule()
    batch = BatchBuilder(4, sched.config.max_pages_per_seq).build(out)
    expected = int(runner.compute_logits(batch).argmax())
    kv.free("r")
    sched = Scheduler(SchedulerConfig(page_size=4), kv)
    req = make_request("r", PROMPTS[1])
    sched.add_request(req)
    out = sched.schedule()
    batch = BatchBuilder(4, sched.config.max_pages_per_seq).build(out)
    assert runner.execute(batch, [req]) == [expected]
    with pytest.raises(ValueError, match="batch samples 1 rows but 0 requests were given"):
        runner.execute(batch, [])
    kv.free("r")
    kv.check_integrity()


def test_the_linear_weights_are_packed_before_the_first_request() -> None:
    """A fresh model's linear layers get their packed copies when the runner is made (on CPU,
    oneDNN's layout), so the first request does not pay for packing."""
    from engine.loaders import load_model
    from engine.model.linear import Linear
    from tests.tiny_engine import TINY

    loaded = load_model("fresh", "dummy", torch.float32, "cpu", dummy_config=TINY)
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight._packed is None for m in linears)
    (spec,) = kv_pool_templates(loaded.config, 4, torch.float32)
    kv = KVCacheManager([dataclasses.replace(spec, num_pages=8)], "none")
    ModelRunner(loaded.model, kv, loaded.config.num_layers, Sampler())
    expected = torch.backends.mkldnn.is_available()  # (packed only where oneDNN runs them)
    assert all((m.packed_weight._packed is not None) == expected for m in linears)
