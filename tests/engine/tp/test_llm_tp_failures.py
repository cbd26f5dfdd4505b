"""The offline API's tensor-parallel ranks when something goes wrong (engine/tp/local_ranks.py,
engine/runner.py, LLMEngine.step): a step interrupted on rank 0 or failing on another rank stops
the ranks at once and says so, rather than leaving them inside its collectives for the group's
timeout (300 s) and every later call with them; a rank that dies at start-up is named at once;
the caller's torch threads come back whatever the order of closes."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from engine.cpu_share import usable_cores
from engine.llm import LLM
from engine.loaders import load_model
from engine.sampling_params import SamplingParams
from engine.tp.local_ranks import TPRanksLost
from tests.engine.tp.conftest import SMALL_ENGINE

pytestmark = pytest.mark.timeout(120)  # (each failure here used to take the 300 s timeout)

SMALL = {**SMALL_ENGINE, "generation_config": "none"}
PROMPT = [[1, 2, 3, 4, 5]]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _generate(llm: LLM) -> list[int]:
    return list(llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_a_step_interrupted_on_rank_0_stops_the_ranks(tp_checkpoints: dict[str, Path]) -> None:
    """Ctrl-C in rank 0's forward pass: the interrupt goes on as it is, the other ranks are
    stopped (they were left waiting in an all-reduce), a later call says why at once, and close
    returns quietly. The next generate waited 300 s and every later call failed the same way."""
    llm = LLM(str(tp_checkpoints["llama"]), tensor_parallel_size=2, **SMALL)
    ranks = llm.engine.local_ranks
    assert ranks is not None
    processes = list(ranks.processes)  # type: ignore[attr-defined]
    assert len(_generate(llm)) == 4
    layer = llm.engine.runner.model.model.layers[1]
    fired: list[int] = []

    def interrupt(_module: object, _args: object) -> None:
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt("Ctrl-C (test)")

    handle = layer.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        _generate(llm)
    handle.remove()
    assert all(p.poll() is not None for p in processes)
    with pytest.raises(TPRanksLost, match="stopped after a failed step.*KeyboardInterrupt"):
        _generate(llm)
    llm.close()


def test_a_rank_that_dies_is_named_and_the_call_ends(tp_checkpoints: dict[str, Path]) -> None:
    """A rank killed between steps: the next step fails at once naming it and its exit, not with
    gloo's "Connection closed by peer"; close returns quietly."""
    llm = LLM(str(tp_checkpoints["llama"]), tensor_parallel_size=2, **SMALL)
    (rank_1,) = llm.engine.local_ranks.processes  # type: ignore[union-attr]
    assert len(_generate(llm)) == 4
    os.kill(rank_1.pid, signal.SIGKILL)
    rank_1.wait(30)
    with pytest.raises(TPRanksLost, match="rank 1 exited with code -9"):
        _generate(llm)
    llm.close()


def test_a_rank_that_dies_at_start_up_is_named_at_once(
    tp_checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The LLM waited the group's whole timeout (300 s) for a rank whose process had exited."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\nif 'engine.tp.rank_main' in ' '.join(sys.orig_argv):\n    os._exit(3)\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    threads = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited with code 3"):
        LLM(str(tp_checkpoints["llama"]), tensor_parallel_size=2, **SMALL)
    assert torch.get_num_threads() == threads


def test_the_callers_threads_come_back_whatever_the_order_of_closes(
    tp_checkpoints: dict[str, Path],
) -> None:
    """Each LLM saved the count it found: with two alive, the second saved the first's rank 0
    count and the caller was left with it."""
    threads = torch.get_num_threads()
    mine = usable_cores() + 1  # (each rank 0 takes half the host's cores: never this many)
    torch.set_num_threads(mine)
    try:
        first = LLM(str(tp_checkpoints["llama"]), tensor_parallel_size=2, **SMALL)
        second = LLM(str(tp_checkpoints["llama"]), tensor_parallel_size=2, **SMALL)
        first.close()
        second.close()
        assert torch.get_num_threads() == mine
    finally:
        torch.set_num_threads(threads)


def test_a_loaded_model_is_one_process_s_whole(tp_checkpoints: dict[str, Path]) -> None:
    """LLM.from_loaded(..., tensor_parallel_size=2) ran at tp 1 without a word."""
    loaded = load_model(str(tp_checkpoints["llama"]))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 with a loaded model"):
        LLM.from_loaded(loaded, tensor_parallel_size=2, **SMALL_ENGINE)
