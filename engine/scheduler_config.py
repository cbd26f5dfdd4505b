"""The scheduler's limits: immutable, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of the continuous-batching scheduler."""

    max_num_seqs: int = 256
    """Most requests running at once (decoding or in a prefill chunk)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decode tokens plus prefill chunk tokens."""
    prefill_chunk_size: int = 512
    """Most prompt tokens of one request computed in one step; longer prompts are chunked."""
    max_model_len: int = 2048
    """Longest sequence (prompt + output); a request reaching it finishes with "length"."""
    page_size: int = 16
    """Tokens per KV page; must equal the KV cache manager's page size."""

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_chunk_size",
            "max_model_len",
            "page_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 1, got {value!r}")

    @property
    def max_pages_per_seq(self) -> int:
        """Pages that one sequence of ``max_model_len`` tokens can hold."""
        return -(-self.max_model_len // self.page_size)
