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
    repetition_penalty: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    allowed_token_ids: list[int] | None = None,
) -> list[int]:
    """transformers' greedy continuation of one prompt (the oracle), stopping at EOS like the
    engine; ``min_new_tokens`` masks the EOS ids until then (the oracle of min_tokens),
    ``repetition_penalty`` is transformers' RepetitionPenaltyLogitsProcessor, and ``logit_bias``
    its SequenceBiasLogitsProcessor over one-token sequences, ``allowed_token_ids`` its
    ``prefix_allowed_tokens_fn`` allowing the same tokens at every step."""
    bias = None if not logit_bias else {(t,): b for t, b in logit_bias.items()}
    allowed = None if allowed_token_ids is None else (lambda _b, _ids: list(allowed_token_ids))
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            repetition_penalty=repetition_penalty,
            sequence_bias=bias,
            prefix_allowed_tokens_fn=allowed,
            eos_token_id=list(eos_ids),
            pad_token_id=int(next(iter(eos_ids))),
        )
    return out[0, len(prompt_ids) :].tolist()


def openai_penalized_greedy(
    hf_model: Any,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    presence_penalty: float,
    frequency_penalty: float,
) -> list[int]:
    """Greedy over transformers' logits with OpenAI's presence and frequency penalties, written
    from their definition (transformers has neither): each step recomputes the whole sequence,
    and a token generated c times loses ``frequency_penalty * c + presence_penalty``."""
    ids = list(prompt_ids)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
            for token in set(out):
                logits[token] -= frequency_penalty * out.count(token) + presence_penalty
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token in eos_ids:
                break
    return out
