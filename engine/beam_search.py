"""Beam search as vLLM's ``LLM.beam_search`` runs it, over any one-token step of the engine.

Each step, every live beam (prompt + tokens so far) is one request of one token asking for the
``2 * beam_width`` most likely next tokens (their raw log probabilities; with a temperature the
sampled token joins them, as in vLLM); the prefix cache serves what the beams share. Every
candidate extends its beam: one ending in EOS (unless ``ignore_eos``) is finished, the others
compete, and the ``beam_width`` best by ``beam_score`` live on. After ``max_tokens`` steps (or when
no beam lives) the finished and the live beams together are ranked the same way, best first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.logprobs import MAX_LOGPROBS, Logprob

# One step: each beam's tokens -> its candidates (token id -> Logprob), as vLLM's logprobs entry.
BeamStep = Callable[[list[list[int]]], list[dict[int, Logprob]]]


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams (same fields and defaults), checked when made."""

    beam_width: int
    """Beams kept at each step, and sequences returned; at most MAX_LOGPROBS // 2 (each step asks
    for 2 * beam_width logprobs, which vLLM's default max_logprobs bounds the same way)."""
    max_tokens: int
    """Tokens each beam may generate (>= 1)."""
    ignore_eos: bool = False
    """EOS does not finish a beam: it is a token like any other."""
    temperature: float = 0.0
    """In [0, 2]; above 0 each step also samples a token at this temperature, which joins the
    candidates when it is not among the most likely already (vLLM's behaviour)."""
    length_penalty: float = 1.0
    """The exponent of the length that a beam's cumulative logprob is divided by (beam_score)."""
    include_stop_str_in_output: bool = False
    """Keep the text of a finishing EOS at the end of ``text`` (its id stays in ``tokens``)."""

    def __post_init__(self) -> None:
        def fail(name: str, expected: str) -> ValueError:
            return ValueError(
                f"BeamSearchParams.{name} must be {expected}, got {getattr(self, name)!r}"
            )

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not (is_int(self.beam_width) and 1 <= self.beam_width <= MAX_LOGPROBS // 2):
            raise fail("beam_width", f"an integer in [1, {MAX_LOGPROBS // 2}]")
        if not (is_int(self.max_tokens) and self.max_tokens >= 1):
            raise fail("max_tokens", "an integer >= 1")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 2:
            raise fail("temperature", "in [0, 2]")
        p = self.length_penalty
        if isinstance(p, bool) or not isinstance(p, (int, float)) or p != p:
            raise fail("length_penalty", "a number")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise fail(name, "a bool")


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM's: ``tokens`` are the prompt's and the generated ones; ``logprobs`` one
    candidates dict per generated token; ``text`` the decoding of ``tokens`` (prompt included,
    special tokens kept, as vLLM's offline beam search writes it). ``finish_reason``: "stop" at
    EOS, "length" otherwise (what vLLM's server reports; its offline API leaves them None)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best sequences of one prompt, best first (at most beam_width of them)."""

    sequences: list[BeamSearchSequence]


def beam_score(
    tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """vLLM's (and transformers') ranking score: the cumulative logprob over the length to the
    power ``length_penalty``, the length being all of ``tokens`` (the prompt too, as vLLM counts)
    less a final EOS."""
    length = len(tokens) - (1 if tokens[-1] == eos_token_id else 0)
    return cum_logprob / (length**length_penalty)


@dataclass
class _Instance:
    beams: list[BeamSearchSequence]
    finished: list[BeamSearchSequence] = field(default_factory=list)


def beam_search(
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    step: BeamStep,
    *,
    eos_token_id: int | None,
    max_model_len: int,
    decode: Callable[[list[int]], str],
    concurrency_limit: int | None = None,
    on_step: Callable[[], None] | None = None,
) -> list[BeamSearchOutput]:
    """Search each prompt (token ids, each shorter than ``max_model_len``); ``step`` runs one
    token of every live beam of up to ``concurrency_limit`` prompts at once (None: all of them),
    ``on_step`` is called after each. A beam that reaches ``max_model_len`` tokens finishes
    there ("length")."""

    def key(beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, eos_token_id, params.length_penalty)

    instances = [_Instance([BeamSearchSequence(list(p))]) for p in prompts]
    batch_size = concurrency_limit or max(len(instances), 1)
    for start in range(0, len(instances), batch_size):
        batch = instances[start : start + batch_size]
        for _ in range(params.max_tokens):
            if not _step(batch, params, step, eos_token_id, max_model_len, key):
                break
            if on_step is not None:
                on_step()
    outputs = []
    for inst in instances:
        for beam in inst.beams:
            beam.finish_reason = "length"
        best = sorted(inst.finished + inst.beams, key=key, reverse=True)[: params.beam_width]
        for beam in best:
            shown = beam.tokens
            if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                shown = shown[:-1]
            beam.text = decode(shown)
        outputs.append(BeamSearchOutput(best))
    return outputs


def _step(
    batch: list[_Instance],
    params: BeamSearchParams,
    step: BeamStep,
    eos_token_id: int | None,
    max_model_len: int,
    key: Callable[[BeamSearchSequence], float],
) -> bool:
    """One token of every live beam of ``batch``; False when none lives."""
    live: list[tuple[_Instance, BeamSearchSequence]] = []
    for inst in batch:
        for beam in inst.beams:
            if len(beam.tokens) >= max_model_len:  # (no room for another token)
                beam.finish_reason = "length"
                inst.finished.append(beam)
            else:
                live.append((inst, beam))
        inst.beams = []
    if not live:
        return False
    grown: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in batch}
    for (inst, beam), candidates in zip(live, step([b.tokens for _, b in live]), strict=True):
        for token_id, logprob in candidates.items():
            child = BeamSearchSequence(
                beam.tokens + [token_id],
                beam.logprobs + [candidates],
                beam.cum_logprob + logprob.logprob,
            )
            if token_id == eos_token_id and not params.ignore_eos:
                child.finish_reason = "stop"
                inst.finished.append(child)
            else:
                grown[id(inst)].append(child)
    for inst in batch:
        inst.beams = sorted(grown[id(inst)], key=key, reverse=True)[: params.beam_width]
    return True
