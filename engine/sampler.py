"""Batched token sampling: greedy, temperature, min_p, top-k and top-p, with per-request
generators, after allowed_token_ids, min_tokens' mask, logit_bias and the penalties
(engine/penalties.py), in vLLM's order.

Random rows sample by the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. picks
token i with probability ``probs[i]``. A request with a seed draws its ``q`` from its own generator,
one vocab-sized draw per sampled token, so its tokens depend only on its own logits and seed, not on
which other requests share the batch. Requests without a seed share the sampler's generator.
"""

from __future__ import annotations

import torch

from engine.logprobs import token_logprobs
from engine.penalties import apply_min_p, apply_penalties
from engine.request import Request


def apply_top_k_top_p(
    logits: torch.Tensor,  # [S, V] float32
    top_k: torch.Tensor | None,  # [S] int64, values in [1, V]
    top_p: torch.Tensor | None,  # [S] float32, values in (0, 1]
) -> torch.Tensor:
    """Logits with every token outside each row's top-k / nucleus set to -inf."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        # Below the k-th logit, not past the k-th rank: a tie with the k-th stays, as in
        # transformers' TopKLogitsWarper and vLLM (which tie survives a sort is arbitrary).
        kth = sorted_logits.gather(-1, (top_k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
        # A row of top_p 1 keeps every token: its float32 cumsum reaches 1.0 before a long
        # tail (tens of thousands of tokens of a 128k vocabulary) whenever it shares the
        # batch with a row of top_p < 1.
        drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        drop[:, 0] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _mask_before_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """``logits`` with each row's EOS and stop token ids at -inf while its request has fewer
    than ``min_tokens`` generated tokens (vLLM's MinTokensLogitsProcessor, transformers'
    MinNewTokensLengthLogitsProcessor); the same tensor when no row needs it."""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[-1]
    for i, r in enumerate(requests):
        # (``min_tokens_masked`` is empty without min_tokens: one slot read per row per step)
        if r.min_tokens_masked and r.num_output_tokens < r.sampling_params.min_tokens:
            ids = [t for t in r.min_tokens_masked if t < vocab]
            rows += [i] * len(ids)
            cols += ids
    if not rows:
        return logits
    where = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(where, torch.tensor(float("-inf"), device=logits.device))


def _keep_allowed(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """``logits`` with every token outside a row's allowed_token_ids at -inf; the same tensor when
    no row restricts (a slot read per row)."""
    rows = [i for i, r in enumerate(requests) if r.allowed_token_ids is not None]
    if not rows:
        return logits
    keep = torch.zeros((len(rows), logits.shape[-1]), dtype=torch.bool, device=logits.device)
    for k, i in enumerate(rows):
        r = requests[i]
        if r.allowed_ids_tensor is None or r.allowed_ids_tensor.device != logits.device:
            r.allowed_ids_tensor = torch.tensor(r.allowed_token_ids, device=logits.device)
        keep[k, r.allowed_ids_tensor] = True
    logits = logits.clone()
    where = torch.tensor(rows, device=logits.device)
    logits[where] = logits[where].masked_fill(~keep, float("-inf"))
    return logits


def _add_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """``logits`` with each row's logit_bias added (OpenAI's); the same tensor when no row has
    one (a slot read per row)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, r in enumerate(requests):
        if r.logit_bias is not None:
            ids, bias = r.logit_bias
            rows += [i] * len(ids)
            cols += ids
            values += bias
    if not rows:
        return logits
    device = logits.device
    where = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    bias_t = torch.tensor(values, dtype=logits.dtype, device=device)
    return logits.index_put(where, bias_t, accumulate=True)


class Sampler:
    """Samples one token per row of logits, each row with its request's SamplingParams."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """Token ids for ``logits`` [S, V] float32, row i sampled for ``requests[i]``."""
        if logits.shape[0] != len(requests):
            raise ValueError(
                f"sample got {logits.shape[0]} logits rows for {len(requests)} requests"
            )
        raw = logits
        logits = _mask_before_min_tokens(_keep_allowed(logits, requests), requests)
        logits = _add_logit_bias(logits, requests)
        logits = apply_penalties(logits, requests)
        tokens = logits.argmax(dim=-1)  # exact greedy; first index among ties, like HF
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if random_rows:
            picked = self._sample_random(logits[random_rows], [requests[i] for i in random_rows])
            tokens[random_rows] = picked
        asking = [i for i, r in enumerate(requests) if r.logprobs is not None]
        if asking:  # (of the raw logits: engine/logprobs.py)
            counts = [requests[i].sampling_params.logprobs or 0 for i in asking]
            for i, entry in zip(asking, token_logprobs(raw[asking], tokens[asking], counts)):
                requests[i].next_logprobs = entry
        return tokens.tolist()

    def _sample_random(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        vocab = logits.shape[-1]
        params = [r.sampling_params for r in requests]
        temps = torch.tensor(
            [p.temperature for p in params], dtype=logits.dtype, device=logits.device
        )
        scaled = logits / temps[:, None]
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor(
                [p.min_p for p in params], dtype=logits.dtype, device=logits.device
            )
            scaled = apply_min_p(scaled, min_p)
        top_k = None
        if any(p.top_k != -1 for p in params):
            top_k = torch.tensor(
                [min(p.top_k, vocab) if p.top_k != -1 else vocab for p in params],
                device=logits.device,
            )
        top_p = None
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor(
                [p.top_p for p in params], dtype=logits.dtype, device=logits.device
            )
        probs = apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)
        noise = torch.empty_like(probs)
        shared = [i for i, r in enumerate(requests) if r.sampling_params.seed is None]
        if shared:
            noise[shared] = torch.empty(
                (len(shared), vocab), dtype=probs.dtype, device=probs.device
            ).exponential_(generator=self.generator)
        for i, r in enumerate(requests):
            if r.sampling_params.seed is not None:
                noise[i].exponential_(generator=self._request_generator(r, noise[i]))
        return (probs / noise).argmax(dim=-1)

    def _request_generator(self, request: Request, draw: torch.Tensor) -> torch.Generator:
        if request.generator is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(request.sampling_params.seed)  # type: ignore[arg-type]  # checked by caller
            # Tokens sampled elsewhere (a decode worker goes on after the prefill worker's first
            # token) took one draw each there: skip them, so that a seed gives the same tokens
            # whichever path the router picks.
            for _ in range(request.num_output_tokens):
                torch.empty_like(draw).exponential_(generator=g)
            request.generator = g
        return request.generator
