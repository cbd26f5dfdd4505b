"""What one scheduling step decided: the batch, and who left the running set."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass
class SchedulerOutput:
    """One step's plan. ``requests[i]`` computes ``num_new_tokens[i]`` tokens starting at its
    ``num_computed_tokens``; ``sample[i]`` says whether that completes the request's known tokens,
    so the step samples its next token (a mid-prompt chunk samples nothing).

    ``released_ids`` are the requests that left the running set since the previous step (finished,
    preempted, aborted, prefilled): the batch builder forgets their page-table rows.
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # finished while scheduling (errors)
    released_ids: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    def add(self, request: Request, num_new_tokens: int) -> None:
        sample = request.num_computed_tokens + num_new_tokens == len(request.all_token_ids)
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)
        self.sample.append(sample)
        # A decode step computes only the newest sampled token; anything else is (re)prefill.
        if (
            num_new_tokens == 1
            and sample
            and request.num_computed_tokens >= len(request.prompt_token_ids)
        ):
            self.num_decode_tokens += 1
        else:
            self.num_prefill_tokens += num_new_tokens

    @property
    def total_num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.requests
