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
    row asks for any). All penalised rows at once, on the (row, token) entries they touch only:
    each request's distinct prompt tokens are found once and kept on it."""
    rows = [i for i, r in enumerate(requests) if r.penalized]
    if not rows:
        return logits
    device, width = logits.device, logits.shape[-1]  # (token ids are below it: make_request)
    asked = [requests[i] for i in rows]
    params = [r.sampling_params for r in asked]
    logits = logits.clone()
    flat = logits.view(-1)
    out_keys = torch.tensor(  # row * width + token, one per generated token
        [rows[k] * width + t for k, r in enumerate(asked) for t in r.output_token_ids],
        dtype=torch.long,
        device=device,
    )
    if any(p.repetition_penalty != 1.0 for p in params):
        repetition = _per_row(logits, rows, [p.repetition_penalty for p in params], 1.0)
        prompts = [rows[k] * width + _prompt_tokens(r, device) for k, r in enumerate(asked)]
        # A key seen twice (a prompt token generated again) is written twice with the same
        # value, both computed from the logits as they were: no need to make the keys distinct.
        seen = torch.cat([*prompts, out_keys])
        values, penalty = flat[seen], repetition[seen // width]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if out_keys.numel() and any(p.presence_penalty or p.frequency_penalty for p in params):
        frequency = _per_row(logits, rows, [p.frequency_penalty for p in params], 0.0)
        presence = _per_row(logits, rows, [p.presence_penalty for p in params], 0.0)
        keys, counts = out_keys.unique(return_counts=True)
        row = keys // width
        flat[keys] -= frequency[row] * counts.to(logits.dtype) + presence[row]
    return logits


def _per_row(
    logits: torch.Tensor, rows: list[int], values: list[float], neutral: float
) -> torch.Tensor:
    """One value per row of ``logits`` (on its device): ``values`` at ``rows``, else ``neutral``."""
    full = [neutral] * logits.shape[0]
    for row, value in zip(rows, values, strict=True):
        full[row] = value
    return torch.tensor(full, dtype=logits.dtype, device=logits.device)


def _prompt_tokens(request: Request, device: torch.device) -> torch.Tensor:
    """The distinct token ids of ``request``'s prompt, found once and kept on the request."""
    if request.prompt_token_set is None:
        request.prompt_token_set = torch.tensor(
            sorted(set(request.prompt_token_ids)), dtype=torch.long, device=device
        )
    return request.prompt_token_set


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``logits`` [S, V] (after temperature) with every token of row i whose probability is below
    ``min_p[i]`` times the row's largest at -inf."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))
