"""The prompts of the offline API as vLLM's ``LLM`` takes them (text, token ids, its TextPrompt /
TokensPrompt dicts; one or a list), each as (its text, its token ids, what an error calls it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.tokenizer import Tokenizer

# A prompt: text, token ids, or vLLM's TextPrompt / TokensPrompt dicts.
Prompt = str | list[int] | Mapping[str, Any]
# (the prompt's text, None for token ids; its token ids; what an error calls it)
EncodedPrompt = tuple[str | None, list[int], str]


def encode_prompts(prompts: object, tokenizer: Tokenizer | None) -> list[EncodedPrompt]:
    """One prompt or a list of them, each encoded (``encode_prompt``); ValueError names a bad one."""
    if (
        isinstance(prompts, (str, Mapping))
        or isinstance(prompts, list)
        and prompts
        and isinstance(prompts[0], int)
    ):
        prompts = [prompts]  # one prompt
    if not isinstance(prompts, Sequence):
        raise ValueError(
            "prompts must be a string, a list of token ids, a prompt dict, or a list of those"
        )
    return [encode_prompt(p, f"prompts[{i}]", tokenizer) for i, p in enumerate(prompts)]


def encode_prompt(prompt: object, what: str, tokenizer: Tokenizer | None) -> EncodedPrompt:
    """Text is encoded with the tokenizer's special tokens (vLLM's default); ids are kept."""
    if isinstance(prompt, Mapping):
        prompt = _prompt_of(prompt, what)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{what}: the prompt is empty")
        if tokenizer is None:
            raise ValueError(f"{what}: this model has no tokenizer; pass token ids instead of text")
        return prompt, list(tokenizer.encode(prompt)), what
    if isinstance(prompt, list):
        return None, list(prompt), what
    raise ValueError(
        f"{what}: expected a string, a list of token ids or a prompt dict, "
        f"got {type(prompt).__name__}"
    )


def _prompt_of(prompt: Mapping[str, Any], what: str) -> str | list[int]:
    """The text or token ids of vLLM's TextPrompt ({"prompt"}: a str) or TokensPrompt
    ({"prompt_token_ids"}: a list of ints); any other key (images, cache salts, ...) is refused
    by name, and so is a value of the other kind (text under prompt_token_ids would otherwise be
    tokenized again, special tokens and all)."""
    keys = set(prompt)
    if keys == {"prompt"}:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"{what}: 'prompt' must be a string (token ids: 'prompt_token_ids')")
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list):
            raise ValueError(
                f"{what}: 'prompt_token_ids' must be a list of token ids, got "
                f"{type(ids).__name__} (text: 'prompt')"
            )
        return ids
    other = sorted(keys - {"prompt", "prompt_token_ids"})
    raise ValueError(
        f"{what}: a prompt dict has one of 'prompt' or 'prompt_token_ids'"
        + (f"; not supported: {other}" if other else f", got {sorted(keys)}")
    )
