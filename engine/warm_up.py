"""The engine's warm-up at build (EngineConfig.warm_up): one greedy request through prefill and a
decode step, then forgotten, so that the first user request finds every kernel set up."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.engine_core import LLMEngine

WARM_UP_REQUEST_ID = "duet-warm-up"
WARM_UP_MAX_STEPS = 8


def warm_up_prompt_len(engine: LLMEngine) -> int:
    """On CPU a two-token prompt does: what costs once there (oneDNN's kernel set-up) does not
    depend on the shapes. Triton instead compiles a kernel once per specialization of its integer
    arguments (1, divisible by 16, neither), and token counts are such arguments: on CUDA the
    prompt is one full prefill chunk (a multiple of 16 by default) and three tokens more, attended
    over that chunk's cached context, and the decode step has one token; a first request then
    finds every prefill and decode kernel built."""
    if engine.kv.device.type != "cuda":
        return 2
    cfg = engine.scheduler.config
    chunk = min(cfg.prefill_chunk_size, cfg.max_num_batched_tokens)
    return max(2, min(chunk + 3, cfg.max_model_len - 2))


def warm_up(engine: LLMEngine) -> None:
    """Run the warm-up request on an idle ``engine``; its steps, stats and KV footprint are dropped
    as if it never ran (KVCacheManager.unrecorded). Greedy, so the sampler's shared generator
    draws nothing."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up needs an idle engine")
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with engine.kv.unrecorded():
        engine.add_request(WARM_UP_REQUEST_ID, [0] * warm_up_prompt_len(engine), params)
        for _ in range(WARM_UP_MAX_STEPS):  # bounded: two prefill chunks and a decode step
            if not engine.has_unfinished():
                break
            engine.step()
        else:
            engine.abort_request(WARM_UP_REQUEST_ID)
    engine.num_iterations = 0
    engine.iteration_stats.drain()
    engine.request_stats.drain()
