"""When a request's computed pages are registered in the prefix index (and so become reusable)."""

from __future__ import annotations

import enum


class ReusePolicy(str, enum.Enum):
    """Prefix reuse policy of a KV cache manager.

    - ``none``: nothing is ever registered; every prefix match is empty.
    - ``all_reusable``: full pages are registered on every ``commit`` call (after each prefill chunk,
      and during decode if the caller commits then), so concurrent requests share sooner.
    - ``per_request``: full pages are registered only on the ``commit`` that says the prompt is done.
    """

    NONE = "none"
    ALL_REUSABLE = "all_reusable"
    PER_REQUEST = "per_request"

    @property
    def reuses(self) -> bool:
        """True when prefix matching is on at all."""
        return self is not ReusePolicy.NONE

    def registers_on_commit(self, prompt_done: bool) -> bool:
        """Whether a ``commit(..., prompt_done)`` call registers pages under this policy."""
        if self is ReusePolicy.ALL_REUSABLE:
            return True
        if self is ReusePolicy.PER_REQUEST:
            return prompt_done
        return False
