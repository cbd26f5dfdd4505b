"""A prefill retried on another worker, end to end below the router: real prefill and decode
workers report into one PerfMetricsCollector, called as the router calls them (attempt 0 fails on
p0, attempt 1 succeeds on p1, d0 takes attempt 1's KV). The request's record is the one that
served it, with its outcome; the failed attempt's report neither ends it nor gets into it."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.collector import PerfMetricsCollector, expected_roles_for
from cluster.config import config_from_dict
from cluster.messages import PerfRecord
from cluster.worker_specs import worker_spec
from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillError, PrefillWorker
from tests.decode_worker.worker_helpers import wait_until_no_page_held
from tests.tiny_engine import greedy, tiny_engine
from transfer import KVReceiver, KVSender, TransceiverConfig
from worker_common.messages import GenerateRequest, Role

CFG = TransceiverConfig(secret="test-secret", lease_s=5.0)


def prefill_worker(
    worker_id: str, collector: PerfMetricsCollector, deadline_s: float
) -> PrefillWorker:
    engine = tiny_engine(64)
    specs = list(engine.kv.specs.values())
    config = config_from_dict({"prefill": {"prefill_deadline_s": deadline_s}})
    return PrefillWorker(
        worker_id,
        engine,
        lambda release: KVSender(engine.kv.buffers, specs, "tiny", CFG, release),
        report=collector.ingest,
        deadlines=worker_spec(config, Role.PREFILL, 0, None, transfer_secret="x").deadlines,
        stats_interval_s=0.05,
    )


async def record_of(collector: PerfMetricsCollector, request_id: str) -> PerfRecord:
    """The request's record, once its reports (sent on the workers' engine ticks) joined."""
    deadline = time.monotonic() + 20
    while True:
        for record in collector.drain():
            if record.request_id == request_id:
                return record
        assert time.monotonic() < deadline, f"no record for {request_id}: {collector.stats()}"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_retried_prefill_is_recorded_as_the_attempt_that_served_it() -> None:
    collector = PerfMetricsCollector(expected_roles_for(aggregated=False))
    p0 = prefill_worker("p0", collector, deadline_s=0.3)
    p1 = prefill_worker("p1", collector, deadline_s=60.0)
    de = tiny_engine(64)
    receiver = KVReceiver(de.kv.buffers, list(de.kv.specs.values()), "tiny", CFG)
    d0 = DecodeWorker("d0", de, receiver, collector.ingest, stats_interval_s=0.05)
    req = GenerateRequest("r", list(range(1, 11)), greedy(4), time.time())

    async def main() -> None:
        first = asyncio.ensure_future(p0.prefill(req))  # attempt 0
        await asyncio.sleep(0)  # queued on p0's engine loop, which stalls past its deadline
        p0.loop.call(lambda e: time.sleep(1.0))
        with pytest.raises(PrefillError, match="prefill_deadline_s"):
            await first
        deadline = time.monotonic() + 20  # p0's abort report reaches the collector first
        while collector.stats().ingested == 0:
            assert time.monotonic() < deadline, "p0 never reported its aborted prefill"
            await asyncio.sleep(0.05)
        assert collector.drain() == []  # a failed attempt does not end the request's record
        again = GenerateRequest(
            req.request_id, req.prompt_token_ids, req.sampling, req.arrival_time, prefill_attempt=1
        )
        pre = await p1.prefill(again)
        deltas = [d async for d in d0.decode(again, pre)]
        assert deltas[-1].finish_reason == "length"
        record = await record_of(collector, "r")
        assert (record.prefill.worker_id, record.decode.worker_id) == ("p1", "d0")
        assert (record.finish_reason, record.output_tokens) == ("length", 4)
        assert record.failed_prefill_attempts == 1
        assert collector.stats().superseded == 1  # p0's report, left out
        await wait_until_no_page_held(d0)

    try:
        asyncio.run(main())
    finally:
        d0.close()
        p0.close()
        p1.close()
