"""The correctness oracle shared by every package's tests: transformers' greedy continuation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def hf_greedy(
    hf_model: Any,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    min_new_tokens: int = 0,
) -> list[int]:
    """transformers' greedy continuation of one prompt (the oracle), stopping at EOS like the
    engine; ``min_new_tokens`` masks the EOS ids until then (the oracle of min_tokens)."""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            eos_token_id=list(eos_ids),
            pad_token_id=int(next(iter(eos_ids))),
        )
    return out[0, len(prompt_ids) :].tolist()
