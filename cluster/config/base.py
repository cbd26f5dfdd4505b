"""The base of every config section, and the error a validator raises to blame named fields."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, and the object is immutable once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class FieldErrors(ValueError):
    """Raised by a cross-field validator to blame one or more fields of its section by name.

    ``issues`` holds (field path relative to the section, message) pairs, e.g.
    ``("prefill_chunk_size", "must be <= max_num_batched_tokens (2048), got 4096")``. The loader
    prefixes each with the section's own path, so the user reads
    ``prefill.scheduler.prefill_chunk_size: must be <= ...``.
    """

    def __init__(self, issues: list[tuple[str, str]]) -> None:
        self.issues = issues
        super().__init__("; ".join(f"{field}: {message}" for field, message in issues))


def check_fields(issues: list[tuple[str, str]]) -> None:
    """Raise FieldErrors when a validator collected any issue."""
    if issues:
        raise FieldErrors(issues)
