"""Acceptance: ``LLM(..., tensor_parallel_size=tp)`` (ranks 1.. as local processes, gloo on
127.0.0.1) gives transformers' greedy tokens on tiny random Llama (8 query heads, 4 KV heads) and
Qwen3 (8 query heads, 2 KV heads: replicated at tp 4) checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.cpu_share import usable_cores
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.conftest_engine import assert_no_leak, hf_greedy
from tests.engine.tp.conftest import SMALL_ENGINE

MAX_TOKENS = 6


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [[0, *torch.randint(5, 300, (n,), generator=gen).tolist()] for n in (3, 11, 21)]


@pytest.mark.parametrize(("name", "tp"), [("llama", 2), ("qwen3", 2), ("qwen3", 4)])
def test_greedy_equals_transformers(name: str, tp: int, tp_checkpoints: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    directory = tp_checkpoints[name]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    threads_before = torch.get_num_threads()
    with LLM(str(directory), tensor_parallel_size=tp, **SMALL_ENGINE) as llm:
        spec = llm.engine.kv.specs["full"]
        heads = hf.config.num_key_value_heads
        assert spec.num_kv_heads == max(1, heads // tp)
        assert (spec.mapper_kind.value == "REPLICATED") == (tp > heads)
        eos = sorted(llm.engine.eos_token_ids)
        batch = prompts()
        outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        for prompt, out in zip(batch, outs, strict=True):
            assert out.token_ids == hf_greedy(hf, prompt, MAX_TOKENS, eos), prompt
        assert_no_leak(llm.engine.kv)
        procs = llm.engine.local_ranks.processes
        # The cores split between the ranks (each with every core ran 5x slower on 2 cores).
        share = max(1, usable_cores() // tp)
        assert torch.get_num_threads() == share
        for p in procs:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                assert f"OMP_NUM_THREADS={share}".encode() in f.read().split(b"\0")
    assert torch.get_num_threads() == threads_before  # (the caller's, back)
    assert all(p.returncode == 0 for p in procs)


def test_bad_tensor_parallel_size_names_the_field(tp_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"LLM.tensor_parallel_size.*8 query heads"):
        LLM(str(tp_checkpoints["llama"]), tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"LLM.tensor_parallel_size must be an integer >= 1"):
        LLM(str(tp_checkpoints["llama"]), tensor_parallel_size=0)


SCRIPT_WITHOUT_CLOSE = """
import sys
from engine.llm import LLM
from engine.sampling_params import SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, page_size=4, num_pages=64, max_model_len=64,
          prefill_chunk_size=16, max_num_batched_tokens=32, max_num_seqs=8)
out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
print("ranks", *[p.pid for p in llm.engine.local_ranks.processes], flush=True)
"""


def test_a_script_that_never_closes_its_llm_ends_its_ranks_quietly(
    tp_checkpoints: dict[str, Path],
) -> None:
    """vLLM's scripts never call close(): the ranks stop with the interpreter. Each logged a
    crash ("tensor-parallel rank 1 failed ... Connection closed by peer") at every such exit."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", SCRIPT_WITHOUT_CLOSE, str(tp_checkpoints["llama"])],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert done.returncode == 0, done.stderr
    assert "failed" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "went away" not in done.stderr, done.stderr
    (pid,) = [int(p) for p in done.stdout.split("ranks", 1)[1].split()]
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
