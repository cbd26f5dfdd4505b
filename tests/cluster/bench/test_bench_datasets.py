"""JSONL and ShareGPT workload files, and their errors (cluster/bench/datasets.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cluster.bench.datasets import WorkloadError, load_jsonl, load_sharegpt


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_text_and_ids(tmp_path: Path, word_codec: Any) -> None:
    path = write(
        tmp_path / "w.jsonl",
        '{"prompt": "w1 w2 w3", "output_len": 5}\n\n{"prompt": [4, 5], "tag": "x"}\n',
    )
    plain = load_jsonl(path, None, default_output_len=7)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in plain] == [
        ("w1 w2 w3", None, 5),
        ([4, 5], 2, 7),
    ]
    counted = load_jsonl(path, None, default_output_len=7, codec=word_codec)
    assert [r.prompt_len for r in counted] == [3, 2]


def test_jsonl_takes_first_num_prompts_without_reading_further(tmp_path: Path) -> None:
    path = write(tmp_path / "w.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\nnot json\n')
    assert [r.prompt for r in load_jsonl(path, 2, default_output_len=1)] == ["a", "b"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{oops", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"text": "a"}', "missing 'prompt'"),
        ('{"prompt": ""}', "non-empty string"),
        ('{"prompt": [1, -2]}', "token ids"),
        ('{"prompt": "a", "output_len": 0}', "'output_len' must be an integer >= 1"),
        ('{"prompt": "a", "output_len": "5"}', "'output_len' must be an integer >= 1"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = write(tmp_path / "bad.jsonl", '{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(WorkloadError, match=message) as info:
        load_jsonl(path, None, default_output_len=4)
    assert str(info.value).startswith(f"{path}:3: ")


def test_jsonl_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot read workload file"):
        load_jsonl(tmp_path / "nope.jsonl", None, 4)
    with pytest.raises(WorkloadError, match="no prompts"):
        load_jsonl(write(tmp_path / "empty.jsonl", "\n\n"), None, 4)


def sharegpt(tmp_path: Path, data: Any) -> Path:
    return write(tmp_path / "sg.json", json.dumps(data))


def convo(human: str, gpt: str) -> dict[str, Any]:
    return {
        "id": "x",
        "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}],
    }


def test_sharegpt_prompts_and_output_lengths(tmp_path: Path, word_codec: Any) -> None:
    data = [
        convo("w1 w2 w3 w4", "w5 w6 w7 w8 w9"),
        {"conversations": [{"from": "human", "value": "alone"}]},
        convo("w6 w7 w8 w9 w10", "w7 w8 w9 w10"),
    ]
    path = sharegpt(tmp_path, data)
    by_prompt = {
        r.prompt: r for r in load_sharegpt(path, 10, default_output_len=9, codec=word_codec)
    }
    assert set(by_prompt) == {"w1 w2 w3 w4", "w6 w7 w8 w9 w10"}  # the one-turn entry is skipped
    assert (by_prompt["w1 w2 w3 w4"].prompt_len, by_prompt["w1 w2 w3 w4"].output_len) == (4, 5)
    assert [r.output_len for r in load_sharegpt(path, 10, default_output_len=9)] == [9, 9]
    assert [r.output_len for r in load_sharegpt(path, 10, 9, word_codec, fixed_output_len=4)] == [
        4,
        4,
    ]


def test_sharegpt_keeps_the_pairs_vllm_keeps(tmp_path: Path, word_codec: Any) -> None:
    """As `vllm bench serve` samples ShareGPT: no prompt or reply under 4 tokens (the reply
    unchecked when its length is fixed), no prompt over 1024, no pair over 2048; the sample is
    still num_prompts long when enough pairs are kept."""
    words = lambda n: " ".join(["w"] * n)  # noqa: E731
    data = [
        convo(words(3), words(10)),  # prompt too short
        convo(words(10), words(3)),  # reply too short
        convo(words(1025), words(10)),  # prompt too long
        convo(words(1000), words(1049)),  # 2049 in all
        *[convo(words(4 + i), words(4)) for i in range(6)],  # kept
    ]
    path = sharegpt(tmp_path, data)
    kept = load_sharegpt(path, 5, 9, word_codec)
    assert len(kept) == 5 and all(4 <= r.prompt_len <= 9 for r in kept)
    fixed = load_sharegpt(path, 10, 9, word_codec, fixed_output_len=2)
    # The reply unchecked, the total taken with the fixed length (1000 + 2 fits).
    assert sorted(r.prompt_len for r in fixed) == [*range(4, 11), 1000]
    with pytest.raises(WorkloadError, match="no conversation within vLLM's ShareGPT limits"):
        load_sharegpt(sharegpt(tmp_path, data[:4]), 5, 9, word_codec)


def test_sharegpt_seeded_sample(tmp_path: Path) -> None:
    path = sharegpt(tmp_path, [convo(f"p{i}", "r") for i in range(20)])
    a = [r.prompt for r in load_sharegpt(path, 5, 4, seed=1)]
    assert len(a) == 5 and len(set(a)) == 5
    assert a == [r.prompt for r in load_sharegpt(path, 5, 4, seed=1)]
    assert a != [r.prompt for r in load_sharegpt(path, 5, 4, seed=2)]
    # --fresh-prompts-per-rate: the next five of the same order, none shared
    b = [r.prompt for r in load_sharegpt(path, 5, 4, seed=1, skip=5)]
    assert len(set(a + b)) == 10
    assert a + b == [r.prompt for r in load_sharegpt(path, 10, 4, seed=1)]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"conversations": []}, "expected a JSON list"),
        (
            [convo("a", "b"), {"turns": []}],
            "entry 1: expected an object with a 'conversations' list",
        ),
        (
            [{"conversations": [{"from": "human"}, {"from": "gpt", "value": "b"}]}],
            "entry 0: turn 0",
        ),
        (
            [{"conversations": [{"from": "human", "value": "a"}]}],
            "no conversation with at least two turns",
        ),
    ],
)
def test_sharegpt_errors(tmp_path: Path, data: Any, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_sharegpt(sharegpt(tmp_path, data), 5, 4)


def test_sharegpt_not_json(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="not a valid JSON file"):
        load_sharegpt(write(tmp_path / "x.json", "[{"), 5, 4)
