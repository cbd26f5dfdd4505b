"""From an OpenAI request body and its prompt's token ids to the router's GenerateRequest: the
checks a body passes only against the model (token ids in its vocabulary, the prompt and
max_tokens within its context, stop strings only with a tokenizer) and its sampling settings,
what the body leaves out taken from the model's defaults."""

from __future__ import annotations

import time
from typing import Protocol

from cluster import openai_schemas as oa
from cluster.http_errors import BadRequest, check_token_ids
from engine.loaders.generation_defaults import GenerationDefaults
from engine.sampling_params import SamplingParams, SamplingParamsError
from worker_common.messages import GenerateRequest


class Admitting(Protocol):
    """What the checks read of the serving backend (part of cluster/server.py ServingBackend)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    sampling_defaults: GenerationDefaults  # what a request leaves out (the model's defaults)
    has_tokenizer: bool  # False: a model of random weights (token ids only, no stop strings)


def prepare_request(
    backend: Admitting,
    body: oa.CompletionRequest | oa.ChatCompletionRequest,
    ids: list[int],
    request_id: str,
) -> GenerateRequest:
    """The request for the router of ``body`` with prompt ``ids``, its id ``request_id``; a
    BadRequest naming the field for what the model cannot take."""
    if not ids:
        raise BadRequest("prompt must not be empty", "prompt")
    check_token_ids(ids, backend.vocab_size, "prompt")
    check_token_ids(body.stop_token_ids or [], backend.vocab_size, "stop_token_ids")
    check_token_ids(list(body.logit_bias or {}), backend.vocab_size, "logit_bias")
    check_token_ids(body.allowed_token_ids or [], backend.vocab_size, "allowed_token_ids")
    # (The messages say "This model's maximum context length is N tokens" as OpenAI's and
    # vLLM's do: clients such as LiteLLM tell a context overflow from other 400s by it.)
    room = backend.max_model_len - len(ids)
    if room < 1:
        raise BadRequest(
            f"The prompt has {len(ids)} tokens. This model's maximum context length is "
            f"{backend.max_model_len} tokens, the prompt and at least one generated token.",
            "prompt",
        )
    asked = body.requested_max_tokens
    if asked is not None and asked > room:
        field = body.max_tokens_field
        raise BadRequest(
            f"{field}: {asked} tokens do not fit after a prompt of {len(ids)} tokens. This "
            f"model's maximum context length is {backend.max_model_len} tokens: at most "
            f"{room} can be generated here.",
            field,
        )
    if asked is None:  # the endpoint's default, else the model's, else what fits
        default = body.DEFAULT_MAX_TOKENS or backend.sampling_defaults.max_tokens
        asked = room if default is None else min(default, room)
    try:
        sampling: SamplingParams = body.sampling(asked, backend.sampling_defaults)
    except SamplingParamsError as e:  # named as the body names it, not as the engine's class
        field = body.max_tokens_field if e.field == "max_tokens" else e.field
        raise BadRequest(f"{field} {e.problem}", field) from e
    except ValueError as e:
        raise BadRequest(str(e)) from e
    if sampling.stop and not backend.has_tokenizer:  # (no text is made: they never match)
        raise BadRequest(
            f"stop strings need the model's tokenizer; {backend.model_name!r} has none "
            "(random weights): use stop_token_ids",
            "stop",
        )
    return GenerateRequest(request_id, ids, sampling, time.time())
