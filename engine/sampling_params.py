"""How one request samples and when it stops: validated when made and at every change."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from engine.logprobs import MAX_LOGPROBS

_GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy (exact argmax)


class SamplingParamsError(ValueError):
    """A SamplingParams field the caller must fix; ``field`` names it, ``problem`` says what is
    wrong with it (the message is the two: "SamplingParams.<field> <problem>")."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"SamplingParams.{field} {problem}")
        self.field = field
        self.problem = problem


def _fail(name: str, expected: str, got: object) -> SamplingParamsError:
    return SamplingParamsError(name, f"must be {expected}, got {got!r}")


# Set while an assignment to a SamplingParams is checked (SamplingParams.__setattr__)
_ASSIGNING: ContextVar[bool] = ContextVar("sampling_params_assigning", default=False)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def last_prompt_tokens(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """``ids`` as ``truncate_prompt_tokens=k`` keeps them: the last k (-1: the last
    max_model_len; None: all)."""
    if k is None:
        return ids
    return ids[-(max_model_len if k == -1 else k) :]


def _is_number(value: object) -> bool:
    """An int or a float, not a bool (a NaN fails every range check after this)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping options (vLLM names and defaults).

    Mutable as vLLM's (``params.max_tokens = 512`` after ``get_default_sampling_params()``, as
    vLLM's examples do), and validated at every assignment as when made: an object that exists
    is valid. A request takes a copy when it is made, so a change later does not reach it.

    ``stop`` accepts one string or a sequence of strings and is stored as a tuple, like
    ``stop_token_ids``. A request stops at the first of: EOS (unless ``ignore_eos``), a token of
    ``stop_token_ids``, a stop string in the decoded text (removed from the text unless
    ``include_stop_str_in_output``), ``max_tokens`` generated tokens, or the model's max length.
    """

    temperature: float = 1.0
    """Softmax temperature in [0, 2] (vLLM's and OpenAI's range); 0 means greedy (exact argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p; in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0, as in vLLM; stored as -1) keeps all."""
    max_tokens: int | None = 16
    """Maximum number of generated tokens (>= 1); None: up to the model's max length, as in
    vLLM."""
    seed: int | None = None
    """Seed of this request's own generator, in [-2**63, 2**64): the same seed gives the same
    tokens in any batch, aggregated or disaggregated. -1 means none (vLLM's rule)."""
    stop: tuple[str, ...] = ()
    """Strings that end generation when they appear in the output text."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (the token stays in ``token_ids``; its text only with
    ``include_stop_str_in_output``, as for EOS)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS tokens."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string, or the text of the token that stopped the request by its id
    (a stop token, a shown EOS), at the end of the text."""
    skip_special_tokens: bool = True
    """Leave special tokens (BOS, EOS, ...) out of the decoded text."""
    spaces_between_special_tokens: bool = True
    """vLLM's: False (with ``skip_special_tokens=False``) writes an added token that follows
    another one as its bare content, without the space a tokenizer's decoder may put between
    them (one without a decoder, or WordPiece's); byte-level BPE puts none, so it changes
    nothing there. Its text comes token by token, as vLLM's fast detokenizer makes it."""
    detokenize: bool = True
    """False: no text is made, token ids only (vLLM's; the text fields stay ""); stop strings,
    which match text, are then refused."""
    min_tokens: int = 0
    """Generated tokens before EOS or a stop token id may be sampled (they are masked until
    then) and before a stop string may match (vLLM's semantics); at most ``max_tokens``."""
    n: int = 1
    """Completions of the prompt. ``engine.LLM`` (and the HTTP server, from its own ``n``) makes
    them as n requests, completion i sampled with seed + i when a seed is given (vLLM's rule);
    one request of the engine (``LLMEngine.make_request``) is one completion and takes n=1."""
    repetition_penalty: float = 1.0
    """> 0; 1 is none. The logit of each token of the prompt or the output is divided by it when
    positive, multiplied by it otherwise (transformers' and vLLM's rule; engine/penalties.py)."""
    presence_penalty: float = 0.0
    """In [-2, 2]: subtracted once from the logit of each token generated so far (OpenAI's)."""
    frequency_penalty: float = 0.0
    """In [-2, 2]: subtracted from the logit of each generated token per time it was generated."""
    min_p: float = 0.0
    """In [0, 1]: when sampling, drop tokens less likely than min_p times the most likely one."""
    logprobs: int | None = None
    """None: none. k in [0, 20]: each generated token's log probability and rank, and the k most
    likely tokens of its position, in the model's own distribution (engine/logprobs.py)."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: >= 1 keeps only the prompt's last k tokens (-1: max_model_len of them, which leaves
    no room for an output token when the prompt is that long). ``engine.LLM`` and the HTTP edge
    cut the prompt (``last_prompt_tokens``) before the request is made."""
    allowed_token_ids: tuple[int, ...] | None = None
    """vLLM's: when given (a non-empty list of token ids), only these may be sampled; every other
    token's logit is -inf before anything else applies (the logprobs stay the model's own)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> a value in [-100, 100] added to its logit before penalties and sampling
    (OpenAI's and vLLM's; -100 all but bans a token, 100 all but forces it). Kept as a copy."""
    prompt_logprobs: int | None = None
    """None: none. k in [0, 20]: each prompt token's log probability and rank given the tokens
    before it, and the k most likely tokens of its position (the first token has none). A request
    asking for them reads nothing from the prefix cache: every position is computed."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        elif isinstance(self.stop, Sequence):
            object.__setattr__(self, "stop", tuple(self.stop))
        else:
            raise _fail("stop", "a string or a list of strings", self.stop)
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        elif isinstance(self.stop_token_ids, Sequence) and not isinstance(self.stop_token_ids, str):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        else:
            raise _fail("stop_token_ids", "a list of token ids", self.stop_token_ids)
        if isinstance(self.allowed_token_ids, Sequence) and not isinstance(
            self.allowed_token_ids, str
        ):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        elif self.allowed_token_ids is not None:
            raise _fail("allowed_token_ids", "a list of token ids, or None", self.allowed_token_ids)
        if isinstance(self.logit_bias, Mapping):  # (a copy: a later change to the caller's
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))  # dict reaches nothing)
        elif self.logit_bias is not None:
            raise _fail("logit_bias", "a dict of token id -> bias, or None", self.logit_bias)
        if self.top_k == 0 and _is_int(self.top_k):
            object.__setattr__(self, "top_k", -1)
        if self.seed == -1 and _is_int(self.seed):
            object.__setattr__(self, "seed", None)
        self._validate()
        object.__setattr__(self, "_made", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if "_made" not in self.__dict__:  # (the dataclass __init__ setting the fields)
            object.__setattr__(self, name, value)
            return
        if name not in self.__dataclass_fields__:
            raise AttributeError(f"SamplingParams has no field {name!r}")
        # Validated (and normalised: a stop string becomes a tuple) as a new object would be,
        # but for the rules between fields (min_tokens <= max_tokens), which would make the order
        # of assignments matter: those hold when a request is made of it (make_request's copy).
        token = _ASSIGNING.set(True)
        try:
            checked = dataclasses.replace(self, **{name: value})
        finally:
            _ASSIGNING.reset(token)
        object.__setattr__(self, name, getattr(checked, name))

    def copy(self) -> SamplingParams:
        return dataclasses.replace(self)

    clone = copy  # (vLLM's name)

    def for_choice(self, i: int) -> SamplingParams:
        """The params of completion ``i`` of several of one prompt (``n``, offline or over HTTP):
        one completion, seeded seed + i (vLLM's rule: the completions differ, and the same call
        gives the same completions again). Only the first computes the prompt's logprobs, for all
        of them (the others may read the prompt from the cache)."""
        seed = None if self.seed is None else self.seed + i
        prompt_logprobs = None if i > 0 else self.prompt_logprobs
        params = dataclasses.replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
        # (seed + i may be -1, which a new object reads as "no seed": this choice is seeded)
        object.__setattr__(params, "seed", seed)
        return params

    def _validate(self) -> None:
        t = self.temperature
        if not (_is_number(t) and 0 <= t <= 2):
            raise _fail("temperature", "in [0, 2]", t)
        p = self.top_p
        if not (_is_number(p) and 0.0 < p <= 1.0):
            raise _fail("top_p", "in (0, 1]", p)
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise _fail("top_k", "-1 or 0 (disabled) or an integer >= 1", self.top_k)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _fail("max_tokens", "an integer >= 1 or None", self.max_tokens)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -2 <= value <= 2):
                raise _fail(name, "in [-2, 2]", value)
        r = self.repetition_penalty
        if not (_is_number(r) and 0 < r < float("inf")):
            raise _fail("repetition_penalty", "a number > 0", r)
        m = self.min_p
        if not (_is_number(m) and 0 <= m <= 1):
            raise _fail("min_p", "in [0, 1]", m)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise _fail(name, f"None or an integer in [0, {MAX_LOGPROBS}]", value)
        if not _is_int(self.n) or self.n < 1:
            raise _fail("n", "an integer >= 1", self.n)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _fail("min_tokens", "an integer >= 0", self.min_tokens)
        if (
            self.max_tokens is not None
            and self.min_tokens > self.max_tokens
            and not _ASSIGNING.get()
        ):
            raise _fail("min_tokens", f"at most max_tokens={self.max_tokens}", self.min_tokens)
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**64):
            # (what torch.Generator.manual_seed takes: beyond it, the step itself would fail)
            raise _fail("seed", "an integer in [-2**63, 2**64) or None", self.seed)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _fail("stop", "non-empty strings", s)
        for tid in self.stop_token_ids:
            if not _is_int(tid) or tid < 0:
                raise _fail("stop_token_ids", "integers >= 0", tid)
        k = self.truncate_prompt_tokens
        if k is not None and not (_is_int(k) and (k >= 1 or k == -1)):
            raise _fail("truncate_prompt_tokens", "None, -1 or an integer >= 1", k)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:  # (nothing could be sampled)
                raise _fail("allowed_token_ids", "a non-empty list of token ids", [])
            for tid in self.allowed_token_ids:
                if not _is_int(tid) or tid < 0:
                    raise _fail("allowed_token_ids", "integers >= 0", tid)
        for tid, bias in (self.logit_bias or {}).items():
            if not _is_int(tid) or tid < 0:
                raise _fail("logit_bias", "keyed by token ids (integers >= 0)", tid)
            if not (_is_number(bias) and -100 <= bias <= 100):
                raise _fail("logit_bias", "valued in [-100, 100]", bias)
        if self.stop and self.detokenize is False:
            raise _fail("stop", "empty with detokenize=False (stop strings match text)", self.stop)
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "detokenize",
        ):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, "a bool", getattr(self, name))

    @property
    def penalized(self) -> bool:
        """Asks for a penalty (engine/penalties.py)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 without stop strings)."""
        return max((len(s) for s in self.stop), default=0)
