"""Random and shared-prefix workloads, and the tokenizer helpers (cluster/bench/workloads.py, tokens.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from cluster.bench.tokens import load_embedded_codec
from cluster.bench.workloads import (
    length_bounds,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
)

VOCAB = list(range(100, 150))


def test_length_bounds() -> None:
    assert length_bounds(10, 0.0) == (10, 10)
    assert length_bounds(10, 0.5) == (5, 15)
    assert length_bounds(10, 0.25) == (7, 13)  # (floor and ceil, as vLLM's)
    assert length_bounds(128, 0.3) == (89, 167)
    assert length_bounds(1, 0.9) == (1, 2)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        length_bounds(10, 1.0)
    with pytest.raises(ValueError, match=">= 1"):
        length_bounds(0, 0.0)


def test_random_workload_exact_lengths_token_ids() -> None:
    requests = random_workload(5, input_len=7, output_len=3, vocab=VOCAB, seed=1)
    assert len(requests) == 5
    for r in requests:
        assert isinstance(r.prompt, list) and len(r.prompt) == 7 == r.prompt_len
        assert r.output_len == 3
        assert set(r.prompt) <= set(VOCAB)


def test_random_workload_range_and_seed() -> None:
    requests = random_workload(
        200, input_len=10, output_len=20, vocab=VOCAB, range_ratio=0.5, seed=3
    )
    in_lens = {r.prompt_len for r in requests}
    out_lens = {r.output_len for r in requests}
    assert min(in_lens) >= 5 and max(in_lens) <= 15 and len(in_lens) > 5
    assert min(out_lens) >= 10 and max(out_lens) <= 30
    assert requests == random_workload(200, 10, 20, VOCAB, range_ratio=0.5, seed=3)
    assert requests != random_workload(200, 10, 20, VOCAB, range_ratio=0.5, seed=4)


def test_random_workload_text_prompts_with_codec(word_codec: Any) -> None:
    requests = random_workload(
        4, input_len=6, output_len=2, vocab=list(range(10)), codec=word_codec
    )
    for r in requests:
        assert isinstance(r.prompt, str)
        assert r.prompt_len == 6 == len(r.prompt.split())  # word-level tokens round-trip exactly
        assert all(w.startswith("w") for w in r.prompt.split())


def test_shared_prefix_groups() -> None:
    requests = shared_prefix_workload(
        12, num_groups=3, prefix_len=5, input_len=4, output_len=2, vocab=VOCAB, seed=2
    )
    assert Counter(r.prefix_group for r in requests) == {0: 4, 1: 4, 2: 4}
    prefixes: dict[int | None, set[tuple[int, ...]]] = {}
    for r in requests:
        assert isinstance(r.prompt, list) and r.prompt_len == 9
        prefixes.setdefault(r.prefix_group, set()).add(tuple(r.prompt[:5]))
    assert all(len(p) == 1 for p in prefixes.values())  # one prefix per group
    assert len({next(iter(p)) for p in prefixes.values()}) == 3  # three different prefixes
    assert [r.prefix_group for r in requests] != [i % 3 for i in range(12)]  # shuffled


def test_multi_turn_conversations_extend_their_previous_turn() -> None:
    requests = multi_turn_workload(
        3, num_turns=3, input_len=8, turn_len=4, output_len=2, vocab=VOCAB, seed=5
    )
    assert len(requests) == 9
    assert [r.prefix_group for r in requests] == [0, 1, 2] * 3  # in rounds
    assert [r.after for r in requests] == [None, None, None, 0, 1, 2, 3, 4, 5]
    assert [r.prompt_len for r in requests] == [8] * 3 + [14] * 3 + [20] * 3
    for i in range(3, 9):  # the previous turn, its (drawn) answer of output_len, 4 new tokens
        before, now = requests[i - 3].prompt, requests[i].prompt
        assert isinstance(before, list) and isinstance(now, list)
        assert now[: len(before)] == before and len(now) == len(before) + 2 + 4
    assert len({tuple(r.prompt[:8]) for r in requests[:3]}) == 3  # type: ignore[index]
    assert requests == multi_turn_workload(3, 3, 8, 4, 2, VOCAB, seed=5)
    with pytest.raises(ValueError, match=">= 1 turn"):
        multi_turn_workload(3, 0, 8, 4, 2, VOCAB)


def test_workload_argument_errors() -> None:
    with pytest.raises(ValueError, match="empty"):
        random_workload(1, 4, 4, vocab=[])
    with pytest.raises(ValueError, match="groups"):
        shared_prefix_workload(4, 0, 4, 4, 4, VOCAB)


def test_tokenizer_normal_ids_skip_special_tokens(word_codec: Any) -> None:
    assert word_codec.normal_token_ids() == list(range(11))  # [BOS] (11) is special
    assert word_codec.encode("w3 w1") == [3, 1]
    assert word_codec.decode([3, 1]) == "w3 w1"


@pytest.mark.slow  # parses the GGUF metadata and rebuilds the BPE: seconds
def test_embedded_model_tokenizer() -> None:
    codec = load_embedded_codec()
    ids = codec.normal_token_ids()
    # SmolLM2: 49152 tokens, of which ids 0..16 (<|endoftext|>, <|im_start|>, ...) are control tokens
    assert len(ids) == 49152 - 17
    assert ids[0] == 17 and ids[-1] == 49151
    assert codec.decode(codec.encode("Hello world")) == "Hello world"
    # Random ids decoded to text seldom encode back to as many: each text is fitted to its length
    # (vLLM's random dataset does the same), for every workload's texts.
    for requests in [
        random_workload(20, 64, 2, ids, seed=0, codec=codec),
        random_workload(10, 256, 2, ids, seed=1, codec=codec),
        shared_prefix_workload(6, 2, 32, 16, 2, ids, seed=0, codec=codec),
    ]:
        for r in requests:
            assert len(codec.encode(r.prompt)) == r.prompt_len
        assert {r.prompt_len for r in requests} <= {64, 256, 48}
        assert len({r.prompt_len for r in requests}) == 1


def test_a_flag_of_another_workload_is_refused_not_ignored() -> None:
    """--dataset-path with random prompts ran random prompts and recorded the file's path;
    --prefix-len or --num-turns changed nothing outside their workloads."""
    from cluster.bench.cli import parse_bench_args
    from cluster.bench.datasets import WorkloadError
    from cluster.bench.options import build_workload

    base = ["--tokenizer", "none", "--vocab-size", "100", "--num-prompts", "4"]
    for extra, message in [
        (
            ["--dataset-path", "sharegpt.json"],
            "--dataset-path is read by --workload jsonl / sharegpt",
        ),
        (["--prefix-len", "8"], "--prefix-len is read by --workload shared-prefix"),
        (["--num-turns", "2"], "--num-turns is read by --workload multi-turn"),
    ]:
        with pytest.raises(WorkloadError, match=message):
            build_workload(parse_bench_args([*base, *extra]))
    args = parse_bench_args([*base, "--workload", "shared-prefix", "--input-len", "4"])
    requests = build_workload(args)  # (its own flags at their defaults)
    assert (args.prefix_len, args.num_prefix_groups) == (32, 4)
    assert all(len(r.prompt) == 36 for r in requests)
    # A file's prompts are its own: the synthetic prompts' shape is refused with them.
    file = ["--workload", "jsonl", "--dataset-path", "prompts.jsonl", "--num-prompts", "4"]
    for extra in (["--input-len", "9"], ["--range-ratio", "0.5"], ["--vocab-size", "7"]):
        flag = extra[0]
        with pytest.raises(WorkloadError, match=f"{flag} is read by --workload random / "):
            build_workload(parse_bench_args([*file, "--tokenizer", "none", *extra]))
    args = parse_bench_args(["--tokenizer", "none", "--vocab-size", "100"])
    requests = build_workload(args)  # (random: 64 tokens each, none drawn longer or shorter)
    assert (args.input_len, args.range_ratio) == (64, 0.0)
    assert all(len(r.prompt) == 64 for r in requests)
