"""The log probabilities of prompt tokens (``SamplingParams.prompt_logprobs``; OpenAI's ``echo``
with ``logprobs``, which lm-evaluation-harness scores likelihoods with).

Prompt token t's entry comes from the logits of the row at position t - 1, so a request asking for
them has logits computed on every prompt row, not only on the sampled last one; the first prompt
token has none (vLLM's ``None``). They are the model's raw distribution, as a generated token's
(engine/logprobs.py). A long chunk's rows go through the LM head a slice at a time, so a 2k-token
chunk never holds 2k vocabulary-sized rows at once: at most as many as a step samples
(``max_num_seqs``, the rows the KV sizing's activation estimate leaves room for), and at most
MAX_LOGITS_PER_SLICE floats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.logprobs import token_logprobs
from engine.request import Request

# Logits computed at once for prompt rows: rows x vocabulary at most this many floats (64 MiB).
MAX_LOGITS_PER_SLICE = 16 * 1024 * 1024


@dataclass(frozen=True)
class PromptLogitsRows:
    """The rows of one step's hidden states whose logits score prompt tokens."""

    rows: list[int]  # rows of the step's hidden states, in batch order
    targets: list[int]  # the prompt token each row's logits score
    top_counts: list[int]  # how many most likely tokens each row's request asks for
    owners: list[tuple[Request, int]]  # (request, how many of the rows are its), in row order

    def fill(self, logits_of: Callable[[torch.Tensor], torch.Tensor], step: int) -> None:
        """Score the rows (``logits_of(row indices)`` -> their float32 logits), ``step`` at a time
        (``slice_rows``), and append each request's entries; a request whose prompt is then whole
        gets them as a tuple."""
        entries = []
        for i in range(0, len(self.rows), step):
            logits = logits_of(torch.tensor(self.rows[i : i + step]))
            targets = torch.tensor(self.targets[i : i + step], device=logits.device)
            entries += token_logprobs(logits, targets, self.top_counts[i : i + step])
        at = 0
        for request, count in self.owners:
            scored = request.prompt_logprobs
            assert isinstance(scored, list)  # (only a request that wants them is planned)
            scored += entries[at : at + count]
            at += count
            if len(scored) == request.num_prompt_tokens:
                request.prompt_logprobs = tuple(scored)
                request.wants_prompt_logits = False


def slice_rows(vocab_size: int, max_num_seqs: int) -> int:
    """Prompt rows whose logits are computed at once: no more than a step samples, nor than
    MAX_LOGITS_PER_SLICE floats."""
    return max(1, min(max_num_seqs, MAX_LOGITS_PER_SLICE // max(vocab_size, 1)))


def plan_prompt_logits(
    requests: list[Request], num_new_tokens: list[int]
) -> PromptLogitsRows | None:
    """The rows of this step (requests with their new tokens, packed in order) that score prompt
    tokens not scored yet; None when no request needs any (one attribute read per request)."""
    if not any(r.wants_prompt_logits for r in requests):
        return None
    rows: list[int] = []
    targets: list[int] = []
    counts: list[int] = []
    owners: list[tuple[Request, int]] = []
    first_row = 0
    for r, n in zip(requests, num_new_tokens, strict=True):
        if r.wants_prompt_logits:
            start = r.num_computed_tokens  # the position of this step's first row
            scored = r.prompt_logprobs
            assert isinstance(scored, list)
            # Row of position p scores token p + 1: tokens from the first unscored one (or the
            # first this chunk can score) to the last prompt token this chunk reaches.
            first, last = max(len(scored), start + 1), min(r.num_prompt_tokens - 1, start + n)
            # (positions before ``start`` came from a cached prefix, which have no logits: the
            # scheduler lets no request that wants them read one)
            assert len(scored) >= start + 1, f"{r.request_id!r} read a cached prefix"
            if first <= last:
                rows += range(first_row + first - 1 - start, first_row + last - start)
                targets += r.prompt_token_ids[first : last + 1]
                counts += [r.sampling_params.prompt_logprobs or 0] * (last + 1 - first)
                owners.append((r, last + 1 - first))
        first_row += n
    return PromptLogitsRows(rows, targets, counts, owners) if owners else None
