"""From `duet bench` arguments to a target and a workload (cluster/bench/options.py): the ways a
`vllm bench serve` user writes them, and the settings that must not change a run silently."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from cluster.bench.cli import parse_bench_args
from cluster.bench.datasets import WorkloadError
from cluster.bench.options import build_workload, resolve_target

IDS = ["--tokenizer", "none", "--vocab-size", "100"]


def test_vllm_bench_serve_flag_names_set_the_same_settings() -> None:
    vllm = parse_bench_args(
        [
            "--dataset-name",
            "sharegpt",
            "--random-input-len",
            "7",
            "--random-output-len",
            "3",
            "--random-range-ratio",
            "0.5",
            "--metric-percentiles",
            "99",
            "--endpoint",
            "/v1/chat/completions",
        ]
    )
    ours = parse_bench_args(
        [
            "--workload",
            "sharegpt",
            "--input-len",
            "7",
            "--output-len",
            "3",
            "--range-ratio",
            "0.5",
            "--percentiles",
            "99",
            "--endpoint",
            "chat",
        ]
    )
    assert vars(vllm) == vars(ours)
    assert parse_bench_args(["--endpoint", "/v1/completions"]).endpoint == "completions"
    with pytest.raises(SystemExit):
        parse_bench_args(["--endpoint", "/v1/embeddings"])


@pytest.mark.parametrize(
    ("argv", "target"),
    [
        ([], "configs/local.yaml"),
        (["http://h:1"], "http://h:1"),
        (["--port", "8001"], "http://127.0.0.1:8001"),
        (["--host", "10.1.2.3"], "http://10.1.2.3:8000"),
        (["--host", "::1", "--port", "9"], "http://[::1]:9"),
        (["--host", "[::1]", "--port", "9"], "http://[::1]:9"),  # (already bracketed)
        (["--base-url", "https://api.example:8443"], "https://api.example:8443"),
    ],
)
def test_the_server_is_named_by_target_or_by_vllms_flags(argv: list[str], target: str) -> None:
    assert resolve_target(parse_bench_args(argv)) == target


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["http://h:1", "--port", "2"], "named twice: TARGET http://h:1 and --port"),
        (["--base-url", "http://h:1", "--host", "h"], "--base-url names the whole server"),
        (["--port", "0"], "--port must be within 1..65535"),
    ],
)
def test_a_server_named_two_ways_is_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_target(parse_bench_args(argv))


def test_random_prefix_len_gives_every_prompt_one_shared_prefix() -> None:
    args = parse_bench_args([*IDS, "--num-prompts", "5", "--input-len", "6"])
    plain = build_workload(args)
    shared = build_workload(
        parse_bench_args(
            [*IDS, "--num-prompts", "5", "--input-len", "6", "--random-prefix-len", "10"]
        )
    )
    assert all(len(r.prompt) == 16 and r.prompt_len == 16 for r in shared)
    assert len({tuple(r.prompt[:10]) for r in shared}) == 1  # one prefix for all
    assert len({tuple(r.prompt[10:]) for r in shared}) == 5  # each its own rest
    assert [len(r.prompt) for r in plain] == [6] * 5
    with pytest.raises(WorkloadError, match="--random-prefix-len is read by --workload random"):
        build_workload(
            parse_bench_args([*IDS, "--workload", "shared-prefix", "--random-prefix-len", "4"])
        )


def _sharegpt(tmp_path: Path, n: int) -> Path:
    # Replies of 5 words: with the word codec, 5 tokens each unless a length is fixed.
    data = [
        {
            "conversations": [
                {"from": "human", "value": f"w{i} w1 w2 w3 w4"},
                {"from": "gpt", "value": "w1 w2 w3 w4 w5"},
            ]
        }
        for i in range(n)
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _sharegpt_args(path: Path, *extra: str) -> argparse.Namespace:
    return parse_bench_args(
        ["--workload", "sharegpt", "--dataset-path", str(path), "--num-prompts", "3", *extra]
    )


def test_output_len_fixes_sharegpt_lengths_as_in_vllm(
    tmp_path: Path, word_codec: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was only the fallback for replies no tokenizer counts: with a tokenizer the replies'
    lengths won over a length the user gave."""
    import cluster.bench.options as options

    monkeypatch.setattr(options, "_codec", lambda args: word_codec)
    path = _sharegpt(tmp_path, 3)
    assert [r.output_len for r in build_workload(_sharegpt_args(path))] == [5] * 3
    assert [r.output_len for r in build_workload(_sharegpt_args(path, "--output-len", "9"))] == [
        9
    ] * 3
    fixed = _sharegpt_args(path, "--sharegpt-output-len", "8")
    assert [r.output_len for r in build_workload(fixed)] == [8] * 3
    with pytest.raises(WorkloadError, match="--output-len 9 and --sharegpt-output-len 8 disagree"):
        build_workload(_sharegpt_args(path, "--output-len", "9", "--sharegpt-output-len", "8"))


def test_a_dataset_shorter_than_num_prompts_is_refused_not_run_short(tmp_path: Path) -> None:
    jsonl = tmp_path / "w.jsonl"
    jsonl.write_text('{"prompt": [1, 2]}\n' * 3, encoding="utf-8")
    args = parse_bench_args(
        [
            "--workload",
            "jsonl",
            "--dataset-path",
            str(jsonl),
            "--tokenizer",
            "none",
            "--num-prompts",
            "4",
        ]
    )
    with pytest.raises(WorkloadError, match="has 3 prompts, fewer than --num-prompts 4"):
        build_workload(args)
    args.num_prompts = 3
    assert len(build_workload(args)) == 3
    sharegpt = _sharegpt_args(_sharegpt(tmp_path, 2), "--tokenizer", "none")
    with pytest.raises(WorkloadError, match="has 2 usable prompts, fewer than --num-prompts 3"):
        build_workload(sharegpt)


def test_tokenizer_is_a_file_or_a_checkpoint_directory(tmp_path: Path, word_codec: Any) -> None:
    (tmp_path / "ckpt").mkdir()
    word_codec._tok.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    for given in (tmp_path / "ckpt", tmp_path / "ckpt" / "tokenizer.json"):
        args = parse_bench_args(
            ["--tokenizer", str(given), "--num-prompts", "2", "--input-len", "3"]
        )
        requests = build_workload(args)
        assert all(len(r.prompt) == 3 and max(r.prompt) <= 10 for r in requests)  # its vocabulary
