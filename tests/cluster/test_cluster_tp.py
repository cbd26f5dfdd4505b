"""End to end on CPU with tensor-parallel workers: each worker's ranks are Ray actors in a
placement group of their own (gloo on 127.0.0.1), the official openai client against the HTTP
server, transformers as the oracle (tiny random Llama: 8 query heads, 4 KV heads)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import ray
import torch

from cluster.serve import start_cluster
from tests.cluster.cluster_fixtures import hf_greedy_ids, local_config, wait_no_pages_held
from tests.engine.conftest import write_tiny_checkpoint
from tests.engine.tp.conftest import TP_HF_CONFIGS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tp_cluster") / "llama", TP_HF_CONFIGS["llama"], seed=20
    )


@pytest.fixture(scope="module")
def running(checkpoint: Path) -> Iterator[Any]:
    config = local_config(
        "local_aggregated.yaml",
        model={"source": str(checkpoint), "max_model_len": 64},
        decode={
            "replicas": 1,
            "tensor_parallel_size": 2,
            "resources": {"num_cpus": 0.5, "num_gpus": 0},
            "scheduler": {
                "max_num_seqs": 4,
                "max_num_batched_tokens": 64,
                "prefill_chunk_size": 32,
            },
        },
        kvcache={"page_size": 4, "cpu_bytes": 1 << 20},
        stats={"interval_s": 0.5},
    )
    rc = start_cluster(config)
    yield rc
    rc.stop()


def test_decode_tp2_aggregated_matches_transformers(running: Any, checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    gen = torch.Generator().manual_seed(3)
    for n in (4, 13):
        prompt = [0, *torch.randint(5, 300, (n,), generator=gen).tolist()]
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
        )
        want = hf_greedy_ids(hf, prompt, MAX_TOKENS, [1])
        assert out.choices[0].model_extra["token_ids"] == want, prompt
    (rank0,) = running.handles.decode
    assert ray.get(rank0.handle.ready.remote(), timeout=30)
    assert len(running.handles.placement_groups) == 1
    wait_no_pages_held(running)


def test_a_killed_rank_takes_its_worker_down_and_the_cluster_serves_after_restart(
    running: Any, checkpoint: Path
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    prompt = [0, 17, 29, 31, 42, 57]
    want = hf_greedy_ids(hf, prompt, MAX_TOKENS, [1])
    (slot,) = running.handles.decode
    (rank1,) = ray.get(slot.handle.tp_rank_actors_for_test.remote(), timeout=30)
    ray.kill(rank1, no_restart=True)
    served_by_the_restarted_worker(client, model, prompt, want, slot, rank1)
    wait_no_pages_held(running, timeout_s=60)


def test_a_decode_rank_killed_while_streaming_ends_cleanly_and_leaks_no_page(
    running: Any, checkpoint: Path
) -> None:
    """Rank 1 of the decode tp 2 worker is killed once the stream's first tokens arrived: the
    stream either ends with a clear error (its tokens so far transformers') or is transformers'
    whole answer; then the restarted worker serves transformers' tokens, no rank holding a page."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    prompt, long_tokens = [0, 11, 23, 35, 47, 59], 48
    want_long = hf_greedy_ids(hf, prompt, long_tokens, [1])
    want = want_long[:MAX_TOKENS]
    (slot,) = running.handles.decode
    (rank1,) = ray.get(slot.handle.tp_rank_actors_for_test.remote(), timeout=30)
    got: list[int] = []
    error = None
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=long_tokens, temperature=0.0, stream=True
    )
    try:
        for chunk in stream:
            if chunk.choices:
                got += chunk.choices[0].model_extra["token_ids"]
            if got and rank1 is not None:
                ray.kill(rank1, no_restart=True)
                killed, rank1 = rank1, None
    except openai.APIError as e:
        error = str(e)
    assert rank1 is None, "the stream sent no token"
    if error is None:
        assert got == want_long
    else:
        assert got == want_long[: len(got)] and len(got) < len(want_long), error
        # The engine's failed step (its collective with the lost rank), or the router's word
        # that the decode worker went away: either way an error event, not a hang.
        assert "engine step failed" in error or "decode worker" in error, error
    served_by_the_restarted_worker(client, model, prompt, want, slot, killed)
    wait_no_pages_held(running, timeout_s=60)


def served_by_the_restarted_worker(
    client: openai.OpenAI, model: str, prompt: list[int], want: list[int], slot: Any, killed: Any
) -> None:
    """Send ``prompt`` until the worker that lost rank ``killed`` is back with new ranks and has
    served it. While it goes down and comes back a request either fails with a clear error or is
    served right, never with wrong tokens; within the deadline the restarted worker serves."""
    deadline = time.monotonic() + 240
    errors: list[str] = []
    while True:
        try:
            out = client.completions.create(
                model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
            )
        except openai.APIError as e:
            errors.append(str(e))
            assert time.monotonic() < deadline, errors[-3:]
            time.sleep(1.0)
            continue
        assert out.choices[0].model_extra["token_ids"] == want
        fresh = ray.get(slot.handle.tp_rank_actors_for_test.remote(), timeout=30)
        if fresh and fresh[0]._actor_id != killed._actor_id:
            return  # served by the restarted worker, with new ranks
        assert time.monotonic() < deadline, "the worker was not restarted"
        time.sleep(0.5)
