"""The log probabilities of generated tokens (``SamplingParams.logprobs``, OpenAI's ``logprobs``).

They are the model's own distribution: the log-softmax of the raw logits in float32, before
penalties, min_tokens' mask, temperature, min_p, top-k or top-p (vLLM's default,
``logprobs_mode="raw_logprobs"``; transformers' ``output_logits``). Each generated token gets its
own log probability and rank, and the ``k`` most likely tokens of its position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # most top tokens a request may ask for (OpenAI's top_logprobs, vLLM's default)


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log probability, its rank in the model's distribution (1: the most
    likely), and the ``k`` most likely tokens of its position as (token id, log probability), most
    likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Logprob:
    """vLLM's ``Logprob``: what ``CompletionOutput.logprobs`` maps each token id to."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top_counts: list[int]
) -> list[TokenLogprobs]:
    """The TokenLogprobs of ``tokens`` [R] sampled from the raw ``logits`` [R, V]; row i with its
    ``top_counts[i]`` most likely tokens."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    # (vLLM's rank: a token tied with the sampled one counts as ahead of it)
    ranks = (logprobs >= chosen[:, None]).sum(dim=-1)
    k = min(max(top_counts), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(k, dim=-1)
    rows = zip(
        tokens.tolist(),
        chosen.tolist(),
        ranks.tolist(),
        top_ids.tolist(),
        top_values.tolist(),
        top_counts,
        strict=True,
    )
    return [
        TokenLogprobs(token, value, rank, tuple(zip(ids[:count], values[:count], strict=True)))
        for token, value, rank, ids, values, count in rows
    ]


def as_vllm(entry: TokenLogprobs, name: Callable[[int], str] | None = None) -> dict[int, Logprob]:
    """One position as vLLM's ``SampleLogprobs`` holds it: the sampled token first, then the top
    ones, each with its rank; ``name`` (token id -> text) names them."""

    def named(token: int) -> str | None:
        return name(token) if name is not None else None

    out = {entry.token_id: Logprob(entry.logprob, entry.rank, named(entry.token_id))}
    for i, (token, value) in enumerate(entry.top):
        out.setdefault(token, Logprob(value, i + 1, named(token)))
    return out
