"""Typed messages between the router and the workers (they cross Ray actor boundaries: plain data only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GenerateRequest:
    """One request as the router hands it to a worker. Sampling parameters travel as a plain dict
    (the fields of engine.SamplingParams) and are validated again by the worker's engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    arrival_time: float  # time.time() at the router


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill worker replies once context finalization is done and the pages are leased.

    ``ticket`` is None when the request already finished at its first token (max_tokens == 1 or a
    stop condition); the prefill worker then released the pages itself.
    """

    request_id: str
    first_token_id: int
    first_token_text: str
    finish_reason: str | None
    ticket: Any  # transfer.messages.TransferTicket | None
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenDelta:
    """A piece of a streamed answer: new tokens, their text, and the finish reason on the last one."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # set when the request failed on our side
