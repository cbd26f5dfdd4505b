"""RequestReporter on a real tiny engine: the engine's request stats plus the worker's facts become
one RequestTimings per request and role, and facts never outlive their request."""

from __future__ import annotations

from engine.engine_config import EngineConfig
from engine.engine_core import LLMEngine
from tests.tiny_engine import PAGE, TINY, greedy, tiny_engine
from worker_common.messages import RequestTimings, Role
from worker_common.request_report import RequestReporter, TransferFacts, WorkerFacts


def run(engine: LLMEngine, reporter: RequestReporter) -> None:
    while engine.has_unfinished():
        engine.step()
        reporter.tick(engine)
    reporter.tick(engine)


def test_a_prefill_worker_reports_a_handed_off_request_and_one_that_ended_on_it() -> None:
    engine, sent = tiny_engine(64), []
    reporter = RequestReporter("p0", Role.PREFILL, sent.extend)
    engine.add_request("handed", list(range(1, 11)), greedy(4), prefill_only=True)
    engine.add_request("ended", list(range(20, 30)), greedy(1), prefill_only=True)
    run(engine, reporter)
    by_id: dict[str, RequestTimings] = {t.request_id: t for t in sent}
    handed, ended = by_id["handed"], by_id["ended"]
    assert (handed.role, handed.worker_id, handed.prompt_tokens, handed.output_tokens) == (
        Role.PREFILL,
        "p0",
        10,
        1,
    )
    assert handed.finish_reason is None and handed.finish_time is None and not handed.last_report
    assert handed.queue_start <= handed.queue_end == handed.prefill_start <= handed.prefill_end
    assert ended.finish_reason == "length" and ended.last_report and ended.finish_time is not None
    engine.release("handed")


def test_a_decode_worker_joins_its_transfer_to_the_engines_stats() -> None:
    engine, sent = tiny_engine(64), []
    reporter = RequestReporter("d0", Role.DECODE, sent.extend)
    prompt = list(range(1, 11))
    assert engine.kv.allocate_slots("r", len(prompt) + 1)  # gen-init; the pull filled them
    facts = WorkerFacts(100.0, TransferFacts(100.5, 101.0, 4096, "host_shm"))
    reporter.note("r", facts)
    engine.add_prefilled_request(
        "r", prompt, 7, greedy(5), first_text_sent=0, num_cached_tokens=2 * PAGE
    )
    run(engine, reporter)
    (t,) = sent
    assert (t.arrival_time, t.transfer_start, t.transfer_end) == (100.0, 100.5, 101.0)
    assert (t.transfer_bytes, t.transfer_path) == (4096, "host_shm")
    assert t.output_tokens == 4  # the first of the 5 was sampled (and is reported) by P
    assert len(t.token_gaps_s) == 3 and t.cached_tokens == 8
    assert t.cached_tokens_by_medium == {"device": 8}
    assert t.prefill_start is None and t.first_token_time is None  # P ran the prompt
    assert t.finish_reason == "length" and not t.last_report  # P reports the request too
    assert reporter.num_facts == 0


def test_a_locally_prefilled_request_is_the_decode_workers_last_report() -> None:
    engine, sent = tiny_engine(64), []
    reporter = RequestReporter("d0", Role.DECODE, sent.extend)
    reporter.note("r", WorkerFacts(100.0))
    engine.add_request("r", list(range(1, 11)), greedy(3))
    run(engine, reporter)
    (t,) = sent
    assert t.last_report and t.output_tokens == 3 and t.prefill_start is not None
    assert t.transfer_path is None and t.transfer_bytes == 0


def test_retired_facts_are_dropped_after_what_the_engine_recorded_is_reported() -> None:
    engine, sent = tiny_engine(64), []
    reporter = RequestReporter("d0", Role.DECODE, sent.extend)
    reporter.note("never-added", WorkerFacts(1.0))
    reporter.note("aborted", WorkerFacts(2.0, TransferFacts(2.0, 3.0, 64, "ucx")))
    engine.add_request("aborted", list(range(1, 11)), greedy(50))
    engine.step()
    # The consumer left: the abort and the retire run in one engine call, then the tick.
    engine.abort_request("aborted")
    reporter.retire("aborted")
    reporter.retire("never-added")
    reporter.tick(engine)
    (t,) = sent
    assert t.request_id == "aborted" and t.finish_reason == "abort" and t.transfer_bytes == 64
    assert reporter.num_facts == 0


def test_without_request_stats_nothing_is_reported() -> None:
    engine = LLMEngine.from_config(
        EngineConfig(
            load_format="dummy",
            dummy_config=TINY,
            num_pages=65,  # one max_model_len request (64 pages) + the null page
            page_size=PAGE,
            max_model_len=256,
            max_request_stats_len=0,
        )
    )
    sent: list[RequestTimings] = []
    reporter = RequestReporter("d0", Role.DECODE, sent.extend)
    engine.add_request("r", list(range(1, 11)), greedy(3))
    run(engine, reporter)
    assert sent == [] and len(engine.drain_iteration_stats()) > 0


def test_a_failed_prefill_is_not_the_last_report_and_names_its_attempt() -> None:
    """An aborted (or failed) prefill may be retried elsewhere, or prefilled by the decode worker:
    its report must not close the request's record (the router closes one it gives up on)."""
    engine, sent = tiny_engine(64), []
    reporter = RequestReporter("p0", Role.PREFILL, sent.extend)
    reporter.note("r", WorkerFacts(100.0, prefill_attempt=2))
    engine.add_request("r", list(range(1, 11)), greedy(4), prefill_only=True)
    engine.abort_request("r")
    run(engine, reporter)
    (t,) = sent
    assert (t.finish_reason, t.last_report, t.prefill_attempt) == ("abort", False, 2)
    assert reporter.num_facts == 0
