"""OpenAI request fields Duet does not implement: each is accepted only with a value that asks for
nothing (so a client sending the default still works) and refused otherwise, naming it; a field
that is no OpenAI field at all is refused too (cluster/openai_schemas.py: the bodies that ask)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _none_or(*no_ops: Any) -> Callable[[Any], bool]:
    """A value that asks for nothing: None, or one of ``no_ops``."""
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in no_ops)


def _none_or_a(kind: type) -> Callable[[Any], bool]:
    """Any value of ``kind``: a field that asks nothing of generation whatever its value."""
    return lambda v: v is None or isinstance(v, kind)


# By field: does its value ask for nothing?
_NOT_SUPPORTED_COMMON: dict[str, Callable[[Any], bool]] = {
    "user": _none_or_a(str),  # the end user's id, for the provider's abuse monitoring
    "service_tier": _none_or("auto", "default"),
    "store": _none_or(False),
    "metadata": _none_or({}),
    # vLLM's extensions (clients written for vLLM send their defaults): beam search, priority
    # scheduling, structured output, logits processors, prefix-cache salting, its own KV
    # transfer, custom arguments
    "use_beam_search": _none_or(False),
    "length_penalty": _none_or(1.0, 1),  # (a beam search's only)
    "bad_words": _none_or([]),
    "priority": _none_or(0),
    "response_format": _none_or({"type": "text"}),
    "guided_json": _none_or(),
    "guided_regex": _none_or(),
    "guided_choice": _none_or(),
    "guided_grammar": _none_or(),
    "guided_decoding_backend": _none_or(),
    "guided_whitespace_pattern": _none_or(),
    "structured_outputs": _none_or(),
    "structural_tag": _none_or(),
    "logits_processors": _none_or([]),
    "cache_salt": _none_or(),
    "kv_transfer_params": _none_or(),
    "vllm_xargs": _none_or({}),
    "mm_processor_kwargs": _none_or({}),
}
NOT_SUPPORTED_COMPLETION = _NOT_SUPPORTED_COMMON | {
    "best_of": _none_or(1),
    "suffix": _none_or(""),
    "prompt_embeds": _none_or(),
}
NOT_SUPPORTED_CHAT = _NOT_SUPPORTED_COMMON | {
    "tools": _none_or([]),
    "tool_choice": _none_or("none"),
    "parallel_tool_calls": _none_or_a(bool),  # (about tools, which must be none)
    "functions": _none_or([]),
    "function_call": _none_or("none"),
    "modalities": _none_or(["text"]),
    "audio": _none_or(),
    "prediction": _none_or(),
    "reasoning_effort": _none_or(),
    "verbosity": _none_or(),
    "web_search_options": _none_or(),
    # hints to OpenAI's service that change no answer: a cache key and how long to keep the
    # cache (Duet's prefix cache finds a shared prefix by itself, and keeps pages while it has
    # room) and the end user's id (as ``user``)
    "prompt_cache_key": _none_or_a(str),
    "prompt_cache_retention": _none_or_a(str),
    "safety_identifier": _none_or_a(str),
    # vLLM's: a request's own template (vLLM refuses it unless the server trusts requests'
    # templates); with no reasoning parser, the reasoning stays in the content either way, so
    # only vLLM's default (include it) is honoured
    "chat_template": _none_or(),
    "include_reasoning": _none_or(True),
}
# Of a message (what the OpenAI client's message objects carry back into a conversation).
NOT_SUPPORTED_MESSAGE = {
    "tool_calls": _none_or([]),
    "tool_call_id": _none_or(),
    "function_call": _none_or(),
    "refusal": _none_or(),
    "audio": _none_or(),
    "annotations": _none_or([]),
    "reasoning_content": _none_or(),  # (vLLM's name of an answer's reasoning, then its new one)
    "reasoning": _none_or(),
}


def _shown(value: Any, limit: int = 100) -> str:
    """``value`` as an error message quotes it: cut at ``limit`` characters (a refused field of
    megabytes is not sent back whole)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def refused_fields(
    extra: dict[str, Any] | None, not_supported: dict[str, Callable[[Any], bool]], where: str = ""
) -> list[tuple[str, str]]:
    """(field, message) for every field of ``extra`` (what a body had beyond the fields Duet
    implements) that must be refused: a known OpenAI field asking for something, or an unknown one."""
    refused = []
    for name, value in (extra or {}).items():
        check = not_supported.get(name)
        if check is None:
            refused.append((where + name, f"{where + name}: unknown field"))
        elif not check(value):
            refused.append((where + name, f"{where + name}: not supported, got {_shown(value)}"))
    return refused
