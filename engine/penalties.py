"""vLLM's penalties and min_p, on a batch's logits: what a request asks with
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` and ``min_p``.

- repetition (transformers' RepetitionPenaltyLogitsProcessor, vLLM's rule): the logit of every
  token the request has seen, prompt or output, is divided by the penalty when positive and
  multiplied by it otherwise;
- presence and frequency (OpenAI's): the logit of every token the request has generated loses
  the presence penalty once and the frequency penalty per occurrence (the prompt does not count);
- min_p, after temperature and before top-k / top-p (vLLM's order): tokens whose probability is
  below ``min_p`` times the row's largest are dropped.

Penalties apply before greedy's argmax as before sampling, so they change greedy tokens too.
Rows that ask for none cost one slot read each per step.
"""

from __future__ import annotations

import torch

from engine.request import Request


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """``logits`` [S, V] with each row's penalties applied (a new tensor; the same one when no
    row asks for any)."""
    rows = [i for i, r in enumerate(requests) if r.penalized]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        r, row = requests[i], logits[i]
        params = r.sampling_params
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted({t for t in r.all_token_ids if t < vocab}), device=row.device
            )
            values = row[seen]
            penalty = params.repetition_penalty
            row[seen] = torch.where(values > 0, values / penalty, values * penalty)
        if r.output_token_ids and (params.presence_penalty or params.frequency_penalty):
            out = torch.tensor([t for t in r.output_token_ids if t < vocab], device=row.device)
            ids, counts = out.unique(return_counts=True)
            row[ids] -= params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``logits`` [S, V] (after temperature) with every token of row i whose probability is below
    ``min_p[i]`` times the row's largest at -inf."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))
