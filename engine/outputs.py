"""What the engine hands back per request and step: a small typed message (no tensors)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

from engine.logprobs import Logprob, TokenLogprobs, as_vllm
from engine.request import FinishReason, Request, RequestMetrics


@dataclass
class CompletionOutput:
    """One completion of a prompt, shaped as vLLM's (``RequestOutput.outputs[i]``); ``logprobs``
    and ``cumulative_logprob`` only when the request asked for them (None otherwise, as vLLM's).
    Mutable as vLLM's: post-processing code edits its text in place."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # with SamplingParams.logprobs: one per token
    finish_reason: FinishReason | None
    stop_reason: int | str | None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """The state of one request after a step.

    ``text``/``token_ids`` are cumulative; ``delta_text``/``delta_token_ids`` are what is new since
    the previous output of this request (for streaming). While stop strings could still match, the
    last ``max_stop_len - 1`` characters are held back from ``delta_text`` so a stop string never
    leaks to a stream (none with ``include_stop_str_in_output``); ``text`` always holds everything
    decoded so far (minus a matched stop string).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    metrics: RequestMetrics
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    """With ``SamplingParams.logprobs``: one per token of ``token_ids`` (engine/logprobs.py)."""
    prompt_token_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    """With ``SamplingParams.prompt_logprobs``, once the prompt is computed: one per prompt token,
    the first None (engine/prompt_logprobs.py)."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """The same as vLLM's ``RequestOutput.prompt_logprobs`` holds them (``engine.LLM`` fills it)."""
    choices: tuple[CompletionOutput, ...] = ()
    """With ``SamplingParams.n`` > 1 (``engine.LLM``): every completion of the prompt, in order;
    the fields above are then the first's. Empty for one completion (``outputs`` makes it)."""

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache (vLLM's ``RequestOutput.num_cached_tokens``)."""
        return self.metrics.num_cached_tokens

    @functools.cached_property
    def outputs(self) -> list[CompletionOutput]:
        """The prompt's completions as vLLM's ``RequestOutput.outputs`` holds them: code written
        for vLLM reads ``out.outputs[0].text`` here too. One list per output, made when first
        read: a rerank in place (``out.outputs.sort(...)``) stays (a fresh list at every read
        dropped it, and ``out.outputs[0]`` was not the best one)."""
        return list(self.choices) if self.choices else [self.completion(0)]

    def completion(
        self, index: int, decode: Callable[[int], str] | None = None
    ) -> CompletionOutput:
        """This request's completion as choice ``index``; ``decode`` names the logprobs' tokens."""
        entries = None if self.logprobs is None else [as_vllm(e, decode) for e in self.logprobs]
        total = None if self.logprobs is None else sum(e.logprob for e in self.logprobs)
        return CompletionOutput(
            index,
            self.text,
            self.token_ids,
            total,
            entries,
            self.finish_reason,
            self.stop_reason,
        )

    def with_token_texts(self, decode: Callable[[int], str] | None) -> RequestOutput:
        """The same output with its logprobs and prompt logprobs as vLLM's, their tokens named by
        ``decode`` (vLLM's ``decoded_token``; None: left None, as for a request vLLM does not
        detokenize); itself when it has neither."""
        if self.logprobs is None and self.prompt_token_logprobs is None:
            return self
        return dataclasses.replace(
            self,
            choices=() if self.logprobs is None else (self.completion(0, decode),),
            prompt_logprobs=self._named_prompt_logprobs(decode),
        )

    def _named_prompt_logprobs(
        self, decode: Callable[[int], str] | None
    ) -> list[dict[int, Logprob] | None] | None:
        if self.prompt_token_logprobs is None:
            return None
        return [None if e is None else as_vllm(e, decode) for e in self.prompt_token_logprobs]

    @classmethod
    def of_choices(
        cls,
        request_id: str,
        choices: list[RequestOutput],
        decode: Callable[[int], str] | None = None,
    ) -> RequestOutput:
        """The finished completions of one prompt (each a request of its own) as one output;
        ``decode`` names the logprobs' tokens."""
        return dataclasses.replace(
            choices[0],
            request_id=request_id,
            # (the prompt's logprobs: the first completion's, which alone asks for them)
            prompt_logprobs=choices[0]._named_prompt_logprobs(decode),
            choices=tuple(c.completion(i, decode) for i, c in enumerate(choices)),
        )

    @classmethod
    def from_request(cls, request: Request) -> RequestOutput:
        """Snapshot ``request`` and advance its streaming cursors."""
        finished = request.is_finished
        text = request.output_text
        stream_end = len(text)
        params = request.sampling_params
        # A kept stop string ends the text after itself, past all that was sent: nothing sent can
        # be taken back, so nothing is held (as in vLLM).
        hold = 0 if params.include_stop_str_in_output else params.max_stop_len - 1
        if not finished and hold > 0:
            stream_end = max(request.num_text_sent, stream_end - hold)
        delta_text = text[request.num_text_sent : stream_end]
        request.num_text_sent = stream_end
        delta_ids = request.output_token_ids[request.num_tokens_sent :]
        request.num_tokens_sent = request.num_output_tokens
        return cls(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=text,
            token_ids=list(request.output_token_ids),
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            finished=finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            metrics=dataclasses.replace(request.metrics),
            error=request.error,
            logprobs=None if request.logprobs is None else tuple(request.logprobs),
            # (shared, not copied: a tuple once the prompt is whole)
            prompt_token_logprobs=request.prompt_logprobs
            if isinstance(request.prompt_logprobs, tuple)
            else None,
        )
