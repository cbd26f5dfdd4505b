"""Synthetic workloads: random prompts, shared-prefix groups and multi-turn conversations, seeded
and reproducible.

Prompts are token ids drawn uniformly from ``vocab`` (the normal token ids of the model, see
``tokens.py``), so their length is exact. With ``codec`` the ids are decoded to text instead (for the
chat endpoint): a text of random tokens seldom encodes back to as many, so it is re-encoded and cut
or topped up until it does (as vLLM's random dataset does); ``prompt_len`` is that text's length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cluster.bench.records import BenchRequest
from cluster.bench.tokens import TokenCodec


def length_bounds(mean: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds of lengths around ``mean``: [floor(mean (1 - r)), ceil(mean (1 + r))], at
    least 1 (vLLM's random dataset's).

    ``range_ratio`` r is within [0, 1); 0 gives every request exactly ``mean`` tokens.
    """
    if mean < 1:
        raise ValueError(f"length must be >= 1, got {mean}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be within [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1.0 - range_ratio)))
    high = max(low, math.ceil(mean * (1.0 + range_ratio)))
    return low, high


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    low, high = length_bounds(mean, range_ratio)
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def _draw_ids(rng: np.random.Generator, vocab: np.ndarray, n: int) -> list[int]:
    return [int(x) for x in vocab[rng.integers(0, len(vocab), size=n)]]


# Re-encodings of a prompt's text to fit its length (vLLM's gen_prompt_decode_to_target_len).
FIT_TRIES = 10


def _request(
    ids: list[int],
    output_len: int,
    codec: TokenCodec | None,
    group: int | None,
    after: int | None = None,
    draw: tuple[np.random.Generator, np.ndarray] | None = None,
) -> BenchRequest:
    if codec is None:
        return BenchRequest(ids, len(ids), output_len, group, after)
    assert draw is not None, "a workload of texts draws its top-ups"
    text, prompt_len = _text_of_length(ids, codec, *draw)
    return BenchRequest(text, prompt_len, output_len, group, after)


def _text_of_length(
    ids: list[int], codec: TokenCodec, rng: np.random.Generator, pool: np.ndarray
) -> tuple[str, int]:
    """A text that encodes to ``len(ids)`` tokens, and its length: the ids decoded, re-encoded,
    then cut or topped up with random ids and decoded again, up to FIT_TRIES times (a text of
    random tokens seldom encodes back to as many); the length it has after the last try."""
    target = len(ids)
    for _ in range(FIT_TRIES):
        text = codec.decode(ids)
        ids = codec.encode(text)
        if len(ids) == target:
            return text, target
        ids = ids[:target] if len(ids) > target else ids + _draw_ids(rng, pool, target - len(ids))
    text = codec.decode(ids)
    return text, len(codec.encode(text))


def _check_vocab(vocab: Sequence[int]) -> np.ndarray:
    if len(vocab) == 0:
        raise ValueError("the token vocabulary to draw prompts from is empty")
    return np.asarray(vocab, dtype=np.int64)


def random_workload(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab: Sequence[int],
    range_ratio: float = 0.0,
    seed: int = 0,
    codec: TokenCodec | None = None,
    prefix_len: int = 0,
) -> list[BenchRequest]:
    """``num_prompts`` independent random prompts; input and output lengths per ``length_bounds``.
    With ``prefix_len`` every prompt starts with the same ``prefix_len`` random tokens (`vllm
    bench serve`'s --random-prefix-len: a system prompt's reuse), then its own ``input_len``."""
    if prefix_len < 0:
        raise ValueError(f"prefix length must be >= 0, got {prefix_len}")
    ids_pool = _check_vocab(vocab)
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    # (drawn after the lengths: without a prefix the prompts are those of earlier versions)
    prefix = _draw_ids(rng, ids_pool, prefix_len)
    return [
        _request(prefix + _draw_ids(rng, ids_pool, n_in), n_out, codec, None, draw=(rng, ids_pool))
        for n_in, n_out in zip(in_lens, out_lens, strict=True)
    ]


def shared_prefix_workload(
    num_prompts: int,
    num_groups: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    vocab: Sequence[int],
    range_ratio: float = 0.0,
    seed: int = 0,
    codec: TokenCodec | None = None,
) -> list[BenchRequest]:
    """Requests in ``num_groups`` groups; those of a group start with the same ``prefix_len`` ids.

    Request i belongs to group i % num_groups; after its group's prefix comes a random suffix of
    ``input_len`` tokens (within the range ratio), so prompts are prefix_len + suffix tokens long.
    The order is shuffled (seeded) so that members of a group do not always arrive back to back.
    """
    if num_groups < 1:
        raise ValueError(f"the number of prefix groups must be >= 1, got {num_groups}")
    if prefix_len < 0:
        raise ValueError(f"prefix length must be >= 0, got {prefix_len}")
    ids_pool = _check_vocab(vocab)
    rng = np.random.default_rng(seed)
    prefixes = [_draw_ids(rng, ids_pool, prefix_len) for _ in range(num_groups)]
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    requests = [
        _request(
            prefixes[i % num_groups] + _draw_ids(rng, ids_pool, in_lens[i]),
            out_lens[i],
            codec,
            i % num_groups,
            draw=(rng, ids_pool),
        )
        for i in range(num_prompts)
    ]
    order = rng.permutation(num_prompts)
    return [requests[int(i)] for i in order]


def multi_turn_workload(
    num_conversations: int,
    num_turns: int,
    input_len: int,
    turn_len: int,
    output_len: int,
    vocab: Sequence[int],
    range_ratio: float = 0.0,
    seed: int = 0,
    codec: TokenCodec | None = None,
) -> list[BenchRequest]:
    """``num_conversations`` conversations of ``num_turns`` turns each, in rounds (every first turn,
    then every second turn, ...).

    A first turn is ``input_len`` random tokens; turn k + 1 is turn k's prompt, then an answer of
    ``output_len`` tokens, then ``turn_len`` new tokens (each within the range ratio). The answer
    is drawn here, not the model's: a later turn reuses the earlier prompts' KV on whichever worker
    keeps it, not the decode worker's generated pages. Each later turn is sent after the previous
    turn of its conversation ended (``BenchRequest.after``).
    """
    if num_conversations < 1 or num_turns < 1:
        raise ValueError(
            f"need >= 1 conversation and >= 1 turn, got {num_conversations} and {num_turns}"
        )
    ids_pool = _check_vocab(vocab)
    rng = np.random.default_rng(seed)
    history = [
        _draw_ids(rng, ids_pool, n)
        for n in _lengths(rng, input_len, range_ratio, num_conversations)
    ]
    requests: list[BenchRequest] = []
    for turn in range(num_turns):
        out_lens = _lengths(rng, output_len, range_ratio, num_conversations)
        for c in range(num_conversations):
            if turn:
                answer = _draw_ids(rng, ids_pool, requests[-num_conversations].output_len)
                new = _draw_ids(rng, ids_pool, _lengths(rng, turn_len, range_ratio, 1)[0])
                history[c] = history[c] + answer + new
            after = len(requests) - num_conversations if turn else None
            requests.append(
                _request(list(history[c]), out_lens[c], codec, c, after, draw=(rng, ids_pool))
            )
    return requests
