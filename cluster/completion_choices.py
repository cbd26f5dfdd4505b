"""The /v1/completions endpoint's choices, whole and as stream chunks: the text, the token ids and
the logprobs of each, with ``echo`` the prompt before them (vLLM's shape: the prompt's text first,
and with ``logprobs`` the prompt tokens' entries first, the very first one null, each with the
``logprobs`` most likely tokens), with ``max_tokens`` 0 the prompt alone, and vLLM's
``prompt_logprobs`` beside them (null unless computed). A batch of prompts has ``n`` choices per
prompt, prompt k's at k * n .. k * n + n - 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from cluster import openai_responses as resp
from cluster.answers import Choice
from cluster.openai_logprobs import (
    CONTEXT,
    ContextNames,
    completion_logprobs,
    computed,
    prompt_logprobs,
)
from cluster.openai_schemas import CompletionRequest
from engine.logprobs import TokenLogprobs
from worker_common.messages import TokenDelta

PromptEntries = Sequence[TokenLogprobs | None]


class CompletionChoices:
    """The choices of one completions answer to ``body``, over the prompts ``prompt_ids`` whose
    texts are ``prompt_texts`` (used with echo); ``names`` names the logprobs' tokens."""

    def __init__(
        self,
        body: CompletionRequest,
        head: resp.Head,
        prompt_ids: list[list[int]],
        prompt_texts: list[str],
        names: ContextNames,
    ) -> None:
        self.body = body
        self.head = head
        self.prompt_ids = prompt_ids
        self.prompt_texts = prompt_texts
        self.names = names
        self._echoed: set[int] = set()  # choices whose stream sent the prompt
        self._opened: set[int] = set()  # choices whose stream sent a chunk
        self._offsets: dict[int, int] = {}  # each streamed choice's characters so far
        self._last: dict[int, list[int]] = {}  # each streamed choice's last tokens (CONTEXT)

    def _parts(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        entries: Sequence[TokenLogprobs],
        prompt_entries: PromptEntries | None,
        echo: bool,
        offset: int = 0,
        before: Sequence[int] = (),
    ) -> tuple[str, list[int], dict[str, Any] | None]:
        """(text, token ids, logprobs) of a choice or chunk, after the tokens ``before`` (a
        stream's earlier chunks'); ``echo``: the prompt goes first."""
        k = self.body.logprobs
        if self.body.prompt_only:  # (the one token made is left out)
            text, token_ids, entries = "", [], ()
        scored: list[int] = list(token_ids)
        lps: list[TokenLogprobs | None] = list(entries)
        if echo:
            prompt = index // self.body.n
            text = self.prompt_texts[prompt] + text
            if k is not None:
                # (each with the k most likely, as the answer's own tokens, whatever
                # prompt_logprobs asked)
                trimmed = [
                    None if e is None else dataclasses.replace(e, top=e.top[:k])
                    for e in computed(prompt_entries)
                ]
                scored = self.prompt_ids[prompt] + scored
                lps = [*trimmed, *lps]
        logprobs = (
            None if k is None else completion_logprobs(scored, lps, self.names, offset, before)
        )
        return text, token_ids, logprobs

    def whole(self, choices: list[Choice]) -> list[dict[str, Any]]:
        """The choices of a whole answer: each prompt's first choice brought its prompt logprobs
        for the prompt's other choices."""
        out = []
        for index, c in enumerate(choices):
            scored = choices[index - index % self.body.n].prompt_logprobs
            text, token_ids, logprobs = self._parts(
                index, c.text, c.token_ids, c.logprobs, scored, self.body.echo
            )
            choice = resp.completion_choice(index, text, c.end, token_ids, logprobs)
            asked = self.body.prompt_logprobs_asked is not None
            choice["prompt_logprobs"] = prompt_logprobs(scored, self.names.name) if asked else None
            self._with_prompt_ids(index, choice)
            out.append(choice)
        return out

    def _with_prompt_ids(self, index: int, choice: dict[str, Any]) -> None:
        """vLLM's return_token_ids: choice ``index`` names its prompt's token ids."""
        if self.body.return_token_ids:
            choice["prompt_token_ids"] = self.prompt_ids[index // self.body.n]

    def chunk(self, index: int, d: TokenDelta) -> dict[str, Any]:
        """The stream chunk of choice ``index``'s delta ``d``; the prompt goes with its first."""
        # (a choice's first delta brings its first token; the usage chunk's brings none)
        echo = self.body.echo and bool(d.token_ids) and index not in self._echoed
        if echo:
            self._echoed.add(index)
        offset = self._offsets.get(index, 0)
        before = [] if echo else self._last.get(index, [])  # (an echo scores the prompt too)
        text, token_ids, logprobs = self._parts(
            index, d.text, d.token_ids, d.logprobs, d.prompt_logprobs, echo, offset, before
        )
        if logprobs is not None:
            self._offsets[index] = offset + sum(len(t) for t in logprobs["tokens"])
            scored = self.prompt_ids[index // self.body.n] if echo else before
            self._last[index] = [*scored, *token_ids][-CONTEXT:]
        end = resp.Ending(d.finish_reason, d.stop_reason)
        chunk = resp.completion_chunk(self.head, index, text, end, token_ids, logprobs)
        if index not in self._opened:
            self._opened.add(index)
            self._with_prompt_ids(index, chunk["choices"][0])
        return chunk
