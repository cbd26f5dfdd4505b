"""Request bookkeeping, its metrics, and RequestOutput snapshots with streaming deltas."""

from __future__ import annotations

import pytest

from engine.outputs import RequestOutput
from engine.request import Request, RequestMetrics, RequestStatus
from engine.sampling_params import SamplingParams


def test_new_request_state() -> None:
    r = Request("r", [5, 6, 7], SamplingParams(), eos_token_ids=frozenset({2}), arrival_time=100.0)
    assert (r.num_prompt_tokens, r.num_output_tokens, r.num_tokens, r.num_computed_tokens) == (
        3,
        0,
        3,
        0,
    )
    assert r.status is RequestStatus.WAITING and not r.is_finished and r.finish_reason is None
    assert (
        r.eos_token_ids == {2}
        and r.metrics.arrival_time == 100.0
        and r.metrics.num_prompt_tokens == 3
    )
    assert (
        Request(
            "r", [5], SamplingParams(ignore_eos=True), eos_token_ids=frozenset({2})
        ).eos_token_ids
        == set()
    )
    r.prompt_token_ids.append(1)  # the request keeps its own copies
    assert r.all_token_ids == [5, 6, 7]


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(ValueError, match="prompt_token_ids must not be empty"):
        Request("r", [], SamplingParams())


def test_output_tokens_and_recompute_reset() -> None:
    r = Request("r", [5, 6], SamplingParams(), arrival_time=10.0)
    r.append_output_token(9, now=11.0)
    r.append_output_token(8, now=13.0)
    assert r.output_token_ids == [9, 8] and r.all_token_ids == [5, 6, 9, 8]
    m = r.metrics
    assert (m.first_token_time, m.last_token_time, m.num_output_tokens) == (11.0, 13.0, 2)
    assert m.ttft == 1.0 and m.tpot == 2.0 and m.e2e_latency is None
    r.num_computed_tokens, r.page_ids, r.committed_pages = 3, {"full": [4, 5]}, 1
    r.reset_for_recompute()
    assert (r.num_computed_tokens, r.page_ids, r.committed_pages) == (0, {}, 0)
    assert r.output_token_ids == [9, 8]


def test_finish_reasons_of_statuses() -> None:
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.FINISHED_ERROR.finish_reason == "abort"
    for status in (
        RequestStatus.WAITING,
        RequestStatus.RUNNING,
        RequestStatus.PREEMPTED,
        RequestStatus.PREFILLED,
    ):
        assert not status.is_finished and status.finish_reason is None


def test_metrics_without_tokens() -> None:
    m = RequestMetrics(
        arrival_time=1.0, first_token_time=2.0, last_token_time=2.0, num_output_tokens=1
    )
    assert m.tpot is None and m.ttft == 1.0 and RequestMetrics(arrival_time=0.0).ttft is None


def test_output_deltas_hold_back_a_possible_stop_string() -> None:
    r = Request("r", [1], SamplingParams(stop=["xyz"]), prompt="p")
    r.append_output_token(4, now=1.0)
    r.output_text = "hello"
    first = RequestOutput.from_request(r)
    assert (first.delta_text, first.text, first.delta_token_ids, first.token_ids) == (
        "hel",
        "hello",
        [4],
        [4],
    )
    assert not first.finished and first.prompt == "p" and first.prompt_token_ids == [1]
    r.append_output_token(5, now=2.0)
    r.output_text = "hello world"
    second = RequestOutput.from_request(r)
    assert (second.delta_text, second.delta_token_ids) == ("lo wor", [5])
    r.status = RequestStatus.FINISHED_LENGTH
    last = RequestOutput.from_request(r)
    assert (last.delta_text, last.delta_token_ids, last.finished, last.finish_reason) == (
        "ld",
        [],
        True,
        "length",
    )
    assert first.delta_text + second.delta_text + last.delta_text == "hello world"
    assert last.metrics is not r.metrics and last.metrics == r.metrics  # a snapshot
