"""End to end on CPU, disaggregated, with tensor-parallel workers on either side: each decode rank
pulls its KV heads from the prefill ranks holding them (worker_common/tp_transfer.py), the
official openai client against the HTTP server, transformers as the oracle (tiny random Llama: 8
query heads, 4 KV heads). Each test starts a cluster of its own (a module of its own, so that no
other module's cluster shares the 2 CPUs of Ray)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from cluster.serve import start_cluster
from tests.cluster.cluster_fixtures import (
    get_json,
    hf_greedy_ids,
    local_config,
    wait_no_pages_held,
)
from tests.engine.conftest import write_tiny_checkpoint
from tests.engine.tp.conftest import TP_HF_CONFIGS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tp_disagg") / "llama", TP_HF_CONFIGS["llama"], seed=20
    )


def disaggregated_config(checkpoint: Path, prefill_tp: int, decode_tp: int, **transfer: Any) -> Any:
    pool = {"replicas": 1, "resources": {"num_cpus": 0.5, "num_gpus": 0}}
    scheduler = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "prefill_chunk_size": 32}
    return local_config(
        "local.yaml",
        model={"source": str(checkpoint), "max_model_len": 64},
        prefill={**pool, "tensor_parallel_size": prefill_tp, "scheduler": scheduler},
        decode={**pool, "tensor_parallel_size": decode_tp, "scheduler": scheduler},
        kvcache={"page_size": 4, "cpu_bytes": 1 << 20},
        stats={"interval_s": 0.5},
        **({"transfer": transfer} if transfer else {}),
    )


@dataclass
class Served:
    stats: list[Any]  # every worker's, once no rank holds a page
    ids: list[str]  # the requests' ids
    transfers: list[dict[str, Any]]  # /transfer_stats once it has the asked roles' records
    perf: list[dict[str, Any]]  # /perf_metrics once it has every request


def drained_until(url: str, path: str, done: Any, timeout_s: float = 30.0) -> list[Any]:
    """The records of ``path`` (drained on each read), gathered until ``done(records)``."""
    records: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while not done(records):
        assert time.monotonic() < deadline, (path, records)
        time.sleep(0.2)
        records += get_json(url, path)
    return records


def served_like_transformers(
    checkpoint: Path,
    config: Any,
    seed: int,
    lengths: tuple[int, ...],
    roles: tuple[str, ...] = ("send", "recv"),
) -> Served:
    """Start ``config``, ask for prompts of ``lengths`` random tokens through the official openai
    client, assert transformers' greedy tokens for each, and return what the cluster reported
    (the transfer records of ``roles``: a pull that P refused leaves no "send" record)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rc = start_cluster(config)
    try:
        client = openai.OpenAI(base_url=rc.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        gen = torch.Generator().manual_seed(seed)
        ids = []
        for n in lengths:
            prompt = [0, *torch.randint(5, 300, (n,), generator=gen).tolist()]
            out = client.completions.create(
                model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
            )
            assert out.choices[0].model_extra["token_ids"] == hf_greedy_ids(
                hf, prompt, MAX_TOKENS, [1]
            ), prompt
            ids.append(out.id)
        stats = wait_no_pages_held(rc)
        transfers = drained_until(
            rc.url,
            "/transfer_stats",
            lambda rs: (
                {(r["request_id"], r["role"]) for r in rs}
                >= {(i, role) for i in ids for role in roles}
            ),
        )
        perf = drained_until(
            rc.url, "/perf_metrics", lambda rs: {r["request_id"] for r in rs} >= set(ids)
        )
        return Served(stats, ids, transfers, perf)
    finally:
        rc.stop()


def test_failed_pulls_on_every_decode_rank_recompute_and_leak_no_page(checkpoint: Path) -> None:
    """Every pull of both decode ranks fails (injected: P refuses, half the pages land, or all
    land and D fails it): each request is prefilled again on the decode worker (on_failure:
    recompute), its tokens still transformers', and no rank of either worker holds a page."""
    config = disaggregated_config(
        checkpoint,
        1,
        2,
        on_failure="recompute",
        fault_injection={"fraction": 1.0, "points": ["before_data", "mid_data", "before_ack"]},
    )
    served = served_like_transformers(checkpoint, config, 5, (6, 15), roles=("recv",))
    (d_stats,) = [s for s in served.stats if s.role.value == "decode"]
    assert d_stats.transfer.recomputed == 2 and d_stats.transfer.transfers_ok == 0
    recv = [r for r in served.transfers if r["role"] == "recv"]
    assert sorted(r["request_id"] for r in recv) == sorted(served.ids)  # one per request
    assert not any(r["ok"] for r in recv) and d_stats.transfer.failures == 2


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_disaggregated_tp_matches_transformers_and_holds_no_page(
    prefill_tp: int, decode_tp: int, checkpoint: Path
) -> None:
    """Each decode rank pulls its KV heads from the prefill ranks that hold them; the tokens
    through the official openai client are transformers' greedy ones, and afterwards no rank of
    either worker holds a page (rank 0's accounting is every rank's)."""
    config = disaggregated_config(checkpoint, prefill_tp, decode_tp)
    served = served_like_transformers(checkpoint, config, 4, (5, 14))
    (p_stats,) = [s for s in served.stats if s.role.value == "prefill"]
    (d_stats,) = [s for s in served.stats if s.role.value == "decode"]
    assert p_stats.transfer.failures == 0
    # Each request's transfer is one record per side under its own id, joined over the ranks'
    # parts: every KV head of its pages (2 layers, K and V, 4 tokens, 4 KV heads of 8, float32).
    page_bytes = 2 * 2 * 4 * 4 * 8 * 4
    by_key = {(r["request_id"], r["role"]): r for r in served.transfers}
    assert len(by_key) == len(served.transfers) == 2 * len(served.ids)
    perf = {r["request_id"]: r for r in served.perf}
    for rid in served.ids:
        send, recv = by_key[rid, "send"], by_key[rid, "recv"]
        assert send["ok"] and recv["ok"]
        assert send["bytes"] == recv["bytes"] == recv["pages"]["full"] * page_bytes > 0
        assert perf[rid]["transfer_bytes"] == recv["bytes"]
    for stats, role in ((p_stats, "send"), (d_stats, "recv")):
        assert stats.transfer.transfers_ok == len(served.ids)
        assert stats.transfer.bytes == sum(by_key[rid, role]["bytes"] for rid in served.ids)
