"""A hybrid model through the whole disaggregated cluster on CPU: a tiny random Gemma 3 (5 sliding
layers with a window of 32 tokens : 1 full layer) on one prefill and one decode actor of a local
Ray, its KV moved group by group over the shared-memory path (configs/local.yaml), transformers as
the oracle. The prompts are several windows long and P prefills them in chunks across window
boundaries, so P's ticket starts its window group past the prompt's first page; /transfer_stats
shows the window group moving only its window's pages, and D's own prefix hit cutting both."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from cluster.serve import start_cluster
from kvcache.sliding_window import first_needed_page
from tests.cluster.cluster_fixtures import (
    get_json,
    hf_greedy_ids,
    local_config,
    wait_no_pages_held,
)
from tests.engine.conftest import (
    HYBRID_HF_CONFIGS,
    HYBRID_WINDOW,
    TINY_VOCAB,
    write_tiny_checkpoint,
)

pytestmark = pytest.mark.slow

PAGE = 8
WINDOW_GROUP = f"swa_{HYBRID_WINDOW}"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("gemma") / "gemma3", HYBRID_HF_CONFIGS["gemma3"], seed=5
    )


@pytest.fixture(scope="module")
def running(gemma_dir: Path) -> Any:
    scheduler = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "prefill_chunk_size": 40}
    config = local_config(
        model={"source": str(gemma_dir), "max_model_len": 256},
        kvcache={"page_size": PAGE, "cpu_bytes": "8MiB"},
        prefill={"scheduler": scheduler},
        decode={"scheduler": scheduler},
        stats={"interval_s": 0.5},
    )
    rc = start_cluster(config)
    yield rc
    rc.stop()


def pulls(url: str, count: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """The first ``count`` transfer records of each side (decode-0's receives, prefill-0's sends),
    oldest first: the server hands each record out once, every stats.interval_s."""
    recv: list[dict[str, Any]] = []
    send: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while (len(recv) < count or len(send) < count) and time.monotonic() < deadline:
        for r in get_json(url, "/transfer_stats"):
            (recv if r["worker_id"] == "decode-0" else send).append(r)
        time.sleep(0.3)
    assert len(recv) >= count and len(send) >= count, (recv, send)
    return list(zip(recv[:count], send[:count], strict=True))


def test_hybrid_tokens_equal_transformers_and_the_window_group_moves_its_window(
    running: Any, gemma_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(5, TINY_VOCAB, (96,), generator=gen).tolist()
    first = shared + torch.randint(5, TINY_VOCAB, (4,), generator=gen).tolist()  # 100 tokens
    second = shared + torch.randint(5, TINY_VOCAB, (20,), generator=gen).tolist()  # 116 tokens
    client = openai.OpenAI(
        base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )
    model = client.models.list().data[0].id
    for prompt in (first, second):  # one after the other: the second hits what D kept of the first
        r = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        choice = r.choices[0]
        assert choice.token_ids == hf_greedy_ids(hf, prompt, MAX_TOKENS, [1]), len(prompt)

    (recv1, send1), (recv2, send2) = pulls(running.url, 2)
    assert all(r["ok"] and r["path"] == "host_shm" for r in (recv1, send1, recv2, send2))
    # First prompt: D holds nothing of it, so it takes every prompt page of the full group and, of
    # the window group, those from the window of the first decode step on.
    pages = -(-len(first) // PAGE)  # 13
    window_from = first_needed_page(len(first), HYBRID_WINDOW, PAGE)  # (100 - 31) // 8 = 8
    assert recv1["pages"] == {"full": pages, WINDOW_GROUP: pages - window_from} == send1["pages"]
    assert recv1["pages"][WINDOW_GROUP] < recv1["pages"]["full"]
    # Second prompt: D's own cache holds the shared 96 tokens (12 pages) in both groups, so only
    # the last 3 pages of each group move.
    assert recv2["pages"] == {"full": 3, WINDOW_GROUP: 3} == send2["pages"]
    wait_no_pages_held(running)
