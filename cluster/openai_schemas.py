"""OpenAI-compatible request bodies, validated at the HTTP edge (the responses:
cluster/openai_responses.py; the OpenAI fields Duet refuses: cluster/openai_unsupported.py)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from cluster.openai_unsupported import (
    NOT_SUPPORTED_CHAT,
    NOT_SUPPORTED_COMPLETION,
    NOT_SUPPORTED_MESSAGE,
    refused_fields,
)
from engine.loaders.generation_defaults import GenerationDefaults
from engine.logprobs import MAX_LOGPROBS
from engine.sampling_params import SamplingParams, last_prompt_tokens


def _drop_nulls(model: type[BaseModel], data: Any) -> Any:
    """A body's fields of ``model`` sent as null, left out: they take their defaults (the OpenAI
    API makes them nullable)."""
    if isinstance(data, dict) and any(
        v is None and k in model.model_fields for k, v in data.items()
    ):
        return {k: v for k, v in data.items() if v is not None or k not in model.model_fields}
    return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return _drop_nulls(cls, data)

    include_usage: bool = False
    # vLLM's: with include_usage, every chunk says its choice's usage so far.
    continuous_usage_stats: bool = False
    # OpenAI pads stream events with random characters unless told not to; Duet never pads, so
    # only "no padding" can be honoured.
    include_obfuscation: Literal[False] = False


def _first(*values: float | None) -> float:
    """The first value that is not None (the last is never None)."""
    return next(v for v in values if v is not None)


def _prompt_kind(value: Any) -> str:
    """Which form of prompt ``value`` is, by its first element: only that form is validated, so a
    long list with one bad element is one error, not one per element and form."""
    if not isinstance(value, list):
        return "str"
    first = value[0] if value else None
    if isinstance(first, str):
        return "list[str]"
    return "list[list[int]]" if isinstance(first, list) else "list[int]"


# (The tags are the names the union's errors had before: messages and params stay as they were.)
Prompt = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[int], Tag("list[int]")]
    | Annotated[list[str], Tag("list[str]")]
    | Annotated[list[list[int]], Tag("list[list[int]]")],
    Discriminator(_prompt_kind),
]


MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024


class _SamplingFields(BaseModel):
    """The fields both endpoints implement. Anything else a body has is refused, naming it, unless
    it is an OpenAI field with a value that asks for nothing (``refused_fields``). A field sent as
    null has its default (the OpenAI API makes these nullable)."""

    model_config = ConfigDict(extra="allow")
    # None: as many as fit the model after the prompt (the chat API's default, and vLLM's).
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = None

    # None: the served model (vLLM's rule; the OpenAI client always names it)
    model: str | None = None
    # vLLM's: the answer's id is <cmpl|chatcmpl>-<request_id> (an X-Request-Id header wins)
    request_id: str | None = None
    max_tokens: int | None = Field(
        default=None,
        description=(
            "Most tokens to generate; prompt plus max_tokens must fit the model's maximum "
            "length. Default: /v1/completions 16 (OpenAI's), chat as many as fit."
        ),
    )
    # None: the model's default (its generation_config.json), else temperature 1 (0 means greedy),
    # top_p 1, top_k -1 (off), min_p 0, no penalties (engine/penalties.py; min_p and
    # repetition_penalty are vLLM's extensions)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # A 64-bit signed integer, as vLLM's (choice i of n is seeded seed + i: the engine takes
    # seeds below 2**64, so the choices' seeds stay in range).
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    # Bounded: each is checked against every generated token in the worker's step, which every
    # running request waits for (200k stop strings cost about 60 ms a token here). OpenAI takes
    # 4 stop strings, TGI 4 by default; vLLM has no bound.
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    # Token id (a JSON object's keys are strings: "50256") -> a bias in [-100, 100] on its logit.
    logit_bias: dict[int, float] | None = None
    # vLLM's extension: logprobs name tokens "token_id:<id>", not by their text.
    return_tokens_as_token_ids: bool = False
    # vLLM's extension: the answer carries the prompt's token ids (completions: in each choice,
    # chat: beside the choices; a stream: in its first chunk of each choice, chat's once) and
    # each choice's generated ids (which completions and chat streams carry anyway).
    return_token_ids: bool = False
    # vLLM's extension: only these tokens may be sampled.
    allowed_token_ids: list[int] | None = None
    # vLLM's extension: keep only the prompt's last k tokens (-1: max_model_len of them, vLLM's
    # rule, so a prompt that long is still refused: no room is left for an output token).
    truncate_prompt_tokens: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # vLLM's extensions: special tokens left out of the text (kept: spaced apart from each other
    # or not, where the tokenizer spaces them); a matched stop string kept in it.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Choices of one prompt, each sampled on its own (with a seed, choice i takes seed + i).
    n: int = Field(default=1, ge=1, le=128)
    # vLLM's extension: each prompt token's log probability and the k most likely of its position
    # (the first token has none), in the answer's ``prompt_logprobs``; not streamed.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return _drop_nulls(cls, data)

    def sampling(self, max_tokens: int, defaults: GenerationDefaults) -> SamplingParams:
        """The request's SamplingParams, what it leaves out from ``defaults`` (the model's), then
        Duet's (validated here, once; ValueError names the field)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_first(self.temperature, defaults.temperature, 1.0),
            top_p=_first(self.top_p, defaults.top_p, 1.0),
            # (vLLM reads top_k 0 as off, as -1)
            top_k=int(_first(self.top_k, defaults.top_k, -1)) or -1,
            min_p=_first(self.min_p, defaults.min_p, 0.0),
            presence_penalty=_first(self.presence_penalty, defaults.presence_penalty, 0.0),
            frequency_penalty=_first(self.frequency_penalty, defaults.frequency_penalty, 0.0),
            repetition_penalty=_first(self.repetition_penalty, defaults.repetition_penalty, 1.0),
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            logit_bias=self.logit_bias or None,
            allowed_token_ids=self.allowed_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logprobs=self.top_logprobs_asked,
            prompt_logprobs=self.prompt_logprobs_asked,
            truncate_prompt_tokens=self.truncate_prompt_tokens,  # (validated there)
        )

    @property
    def top_logprobs_asked(self) -> int | None:
        """None: no logprobs; k: each token's and the k most likely of its position."""
        return None

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt ``ids`` as ``truncate_prompt_tokens`` cuts it (a bad value is refused when
        the request's SamplingParams are made)."""
        return last_prompt_tokens(ids, self.truncate_prompt_tokens, max_model_len)

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """None: no prompt logprobs; k: each prompt token's and the k most likely of its position."""
        return self.prompt_logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field ``requested_max_tokens`` came from."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: continuous_usage_stats counts only with include_usage."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )

    def _misused(self) -> list[tuple[str, str]]:
        """(field, message) for fields of this body that contradict each other."""
        misused = []
        if self.stream_options is not None and not self.stream:
            misused.append(("stream_options", "stream_options: only with stream: true"))
        if self.prompt_logprobs is not None and self.stream:  # (vLLM's rule)
            misused.append(("prompt_logprobs", "prompt_logprobs: not with stream: true"))
        best_of = (self.model_extra or {}).get("best_of")
        if type(best_of) is int and best_of < self.n:  # (OpenAI's and vLLM's rule)
            misused.append(("best_of", f"best_of: must be >= n ({self.n}), got {best_of}"))
        return misused

    def refused(self) -> list[tuple[str, str]]:
        return refused_fields(self.model_extra, NOT_SUPPORTED_COMPLETION) + self._misused()


class CompletionRequest(_SamplingFields):
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = 16  # OpenAI's (and vLLM's) for this endpoint

    prompt: Prompt
    # Each token's log probability and the most likely of its position (OpenAI's legacy int).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # The prompt before each choice's text, and with logprobs the prompt tokens' before its
    # tokens' (the first prompt token's null); with max_tokens 0, the prompt alone.
    echo: bool = False
    # vLLM's: False encodes a text prompt without the tokenizer's special tokens (BOS).
    add_special_tokens: bool = True

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_asked(self) -> int | None:
        if self.prompt_logprobs is None and self.echo:  # (vLLM's rule: echo scores the prompt)
            return self.logprobs
        return self.prompt_logprobs

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt (one token is made and left out)."""
        return self.echo and self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> int | None:
        return 1 if self.prompt_only else self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, in order: a string or a list of token ids is one; a list of
        either is a batch, whose prompt k has choices k * n .. k * n + n - 1 (OpenAI's order)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if len(p) == 0:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    # The speaker's name: the template gets it (as vLLM hands it on); most templates ignore it.
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    # vLLM's extensions: False renders the messages without the assistant turn's opening;
    # continue_final_message (with add_generation_prompt false) continues the last message;
    # chat_template_kwargs are template variables (Qwen 3's enable_thinking, ...).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the template's ``documents`` variable (retrieved passages, for templates that
    # render them; chat_template_kwargs' own ``documents`` wins, as in vLLM).
    documents: list[dict[str, Any]] | None = None
    # vLLM's: True would add the tokenizer's special tokens on top of the template's (refused).
    add_special_tokens: bool = False
    # vLLM's: the answer starts with the last message's content when that message has the
    # answer's role (a continued message: add_generation_prompt false).
    echo: bool = False
    # Each token's log probability, and the top_logprobs most likely of its position.
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def template_variables(self) -> dict[str, Any] | None:
        """What the chat template gets beyond the messages: ``documents``, then
        chat_template_kwargs."""
        if self.documents is None:
            return self.chat_template_kwargs
        return {"documents": self.documents} | (self.chat_template_kwargs or {})

    @property
    def response_role(self) -> str:
        """The answer's role (vLLM's rule): the assistant's, unless no new turn is opened, when it
        is the last message's, which the answer goes on with."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens: it wins when both are sent.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def refused(self) -> list[tuple[str, str]]:
        refused = refused_fields(self.model_extra, NOT_SUPPORTED_CHAT) + self._misused()
        if self.top_logprobs and not self.logprobs:  # (0 asks nothing: vLLM's rule)
            refused.append(("top_logprobs", "top_logprobs: only with logprobs: true"))
        if self.add_special_tokens:
            refused.append(ADD_SPECIAL_TOKENS_REFUSAL)
        return refused + conversation_refusals(
            self.messages, self.add_generation_prompt, self.continue_final_message
        )


def conversation_refusals(
    messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool
) -> list[tuple[str, str]]:
    """(field, message) for what a conversation may not ask (chat's and /tokenize's rule): the
    message fields Duet does not implement, a continued message that opens a new turn too."""
    refused = []
    if continue_final_message and add_generation_prompt:
        refused.append(
            (
                "continue_final_message",
                "continue_final_message: not with add_generation_prompt true (the first "
                "continues the last message, the second opens a new one)",
            )
        )
    for i, message in enumerate(messages):
        refused += refused_fields(message.model_extra, NOT_SUPPORTED_MESSAGE, f"messages[{i}].")
    return refused


# Chat and /tokenize: the template writes the special tokens a conversation has.
ADD_SPECIAL_TOKENS_REFUSAL = (
    "add_special_tokens",
    "add_special_tokens: only false with messages (the chat template writes the special "
    "tokens; none are added on top)",
)

# Content parts that are text under another name (the Responses API's, which vLLM reads as text).
_TEXT_PARTS = frozenset({"input_text", "output_text"})


def _as_text_part(part: Any) -> Any:
    if isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
        return part | {"type": "text"}
    return part


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (engine.chat_template reads the text parts;
    a message's name goes with it, as vLLM hands it on)."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = [_as_text_part(part) for part in content]
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out
