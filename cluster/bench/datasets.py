"""Workloads read from files: a JSONL file of prompts, and ShareGPT-format JSON.

JSONL: one JSON object per line, ``{"prompt": "text" | [token ids], "output_len": 32}``;
``output_len`` is optional (the default output length is used), other keys are ignored, blank lines
are skipped. Any other line is an error that names the file and line.

ShareGPT: a JSON list of ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
"value": ...}, ...]}``. Entries with fewer than two turns are skipped (as `vllm bench` does); the
first turn is the prompt, and the second turn's length in tokens is the output length when a
tokenizer is given (``fixed_output_len`` overrides it; without either, the default is used).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from cluster.bench.records import BenchRequest, Prompt
from cluster.bench.tokens import TokenCodec


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message names the file and the line or entry."""


def _prompt_len(prompt: Prompt, codec: TokenCodec | None) -> int | None:
    if isinstance(prompt, list):
        return len(prompt)
    return len(codec.encode(prompt)) if codec is not None else None


def _parse_jsonl_line(
    line: str, where: str, default_output_len: int, codec: TokenCodec | None
) -> BenchRequest:
    try:
        obj: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise WorkloadError(
            f"{where}: expected a JSON object with a 'prompt', got {type(obj).__name__}"
        )
    if "prompt" not in obj:
        raise WorkloadError(f"{where}: missing 'prompt'")
    prompt = obj["prompt"]
    is_ids = isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    )
    if not ((isinstance(prompt, str) or is_ids) and len(prompt) > 0):
        raise WorkloadError(
            f"{where}: 'prompt' must be a non-empty string or a non-empty list of token ids (ints >= 0)"
        )
    output_len = obj.get("output_len", default_output_len)
    if not (isinstance(output_len, int) and not isinstance(output_len, bool) and output_len >= 1):
        raise WorkloadError(f"{where}: 'output_len' must be an integer >= 1, got {output_len!r}")
    return BenchRequest(prompt=prompt, prompt_len=_prompt_len(prompt, codec), output_len=output_len)


def load_jsonl(
    path: str | Path,
    num_prompts: int | None,
    default_output_len: int,
    codec: TokenCodec | None = None,
    skip: int = 0,
) -> list[BenchRequest]:
    """The first ``num_prompts`` requests of a JSONL file (all when None), in file order, after
    its first ``skip`` prompts.

    Every line up to the last one used is validated; the first bad one raises WorkloadError naming
    ``path:line``. An empty file is an error too.
    """
    requests: list[BenchRequest] = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if num_prompts is not None and len(requests) >= skip + num_prompts:
                    break
                if not line.strip():
                    continue
                requests.append(
                    _parse_jsonl_line(line, f"{path}:{lineno}", default_output_len, codec)
                )
    except OSError as exc:
        raise WorkloadError(f"cannot read workload file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{path}: not UTF-8 text ({exc.reason})") from None
    if not requests:
        raise WorkloadError(f"{path}: no prompts in the file")
    return requests[skip:]


# The pairs `vllm bench serve` keeps of a ShareGPT file (its sample_sharegpt_requests), so that both
# tools draw the same kind of workload: no prompt or reply under 4 tokens (the reply's length not
# checked when --sharegpt-output-len fixes it), no prompt over 1024, no pair over 2048.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


def _sharegpt_pair_kept(prompt_len: int, output_len: int, output_len_fixed: bool) -> bool:
    if prompt_len < SHAREGPT_MIN_LEN or (not output_len_fixed and output_len < SHAREGPT_MIN_LEN):
        return False
    return (
        prompt_len <= SHAREGPT_MAX_PROMPT_LEN and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN
    )


def _turn_text(entry: Any, turn: int, where: str) -> str:
    value = entry["conversations"][turn]
    if not isinstance(value, dict) or not isinstance(value.get("value"), str):
        raise WorkloadError(f"{where}: turn {turn} must be an object with a string 'value'")
    return value["value"]


def load_sharegpt(
    path: str | Path,
    num_prompts: int,
    default_output_len: int,
    codec: TokenCodec | None = None,
    fixed_output_len: int | None = None,
    seed: int = 0,
    skip: int = 0,
) -> list[BenchRequest]:
    """``num_prompts`` conversations of a ShareGPT file, shuffled with ``seed``, as requests:
    those after the first ``skip`` of that order. With a ``codec`` (the lengths known) only the
    pairs `vllm bench serve` keeps (``_sharegpt_pair_kept``)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise WorkloadError(f"cannot read ShareGPT file {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{path}: not a valid JSON file ({exc})") from None
    if not isinstance(data, list):
        raise WorkloadError(
            f"{path}: expected a JSON list of conversations, got {type(data).__name__}"
        )
    usable: list[tuple[str, str]] = []
    for i, entry in enumerate(data):
        where = f"{path}: entry {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
            raise WorkloadError(f"{where}: expected an object with a 'conversations' list")
        if len(entry["conversations"]) < 2:
            continue
        usable.append((_turn_text(entry, 0, where), _turn_text(entry, 1, where)))
    if not usable:
        raise WorkloadError(f"{path}: no conversation with at least two turns")
    requests = []
    for i in np.random.default_rng(seed).permutation(len(usable)):
        prompt, reply = usable[int(i)]
        prompt_len = _prompt_len(prompt, codec)
        if fixed_output_len is not None:
            output_len = fixed_output_len
        elif codec is not None:
            output_len = max(1, len(codec.encode(reply)))
        else:
            output_len = default_output_len
        if prompt_len is not None and not _sharegpt_pair_kept(
            prompt_len, output_len, fixed_output_len is not None
        ):
            continue
        requests.append(BenchRequest(prompt=prompt, prompt_len=prompt_len, output_len=output_len))
        if len(requests) == skip + num_prompts:
            break
    if skip == 0 and not requests:
        raise WorkloadError(
            f"{path}: no conversation within vLLM's ShareGPT limits (prompt and reply of "
            f">= {SHAREGPT_MIN_LEN} tokens, prompt <= {SHAREGPT_MAX_PROMPT_LEN}, both <= "
            f"{SHAREGPT_MAX_TOTAL_LEN})"
        )
    requests = requests[skip:]
    return requests
