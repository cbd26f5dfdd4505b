"""DecodeWorker with hybrid and tiered KV: a request pulls per pool group what D lacks, and D's own
prefix hit can come from its host tier."""

from __future__ import annotations

import asyncio
import time

import pytest

from decode_worker.worker import DecodeWorker
from tests.decode_worker.worker_helpers import wait_until_no_page_held
from tests.tiny_engine import PAGE, greedy, tiny_engine
from transfer import KVReceiver, TransceiverConfig
from worker_common.messages import GenerateRequest


@pytest.mark.timeout(120)
def test_a_hybrid_request_pulls_per_group_what_d_lacks() -> None:
    """A tiny Gemma 3 prefilled on P in chunks across window boundaries: D allocates only the last
    window's pages of its window group and pulls per group, first all the prompt's pages it lacks,
    then, for a prompt sharing a prefix with the first, only those past its own prefix hit; the
    tokens equal D's own local prefill of the same prompts."""
    from prefill_worker.worker import PrefillWorker
    from tests.tiny_engine import tiny_hybrid_engine
    from transfer import KVSender

    cfg = TransceiverConfig(secret="test-secret")
    pe, de = tiny_hybrid_engine(64), tiny_hybrid_engine(64)
    assert sorted(pe.kv.specs) == ["full", "swa_32"]
    specs = list(pe.kv.specs.values())
    prefill = PrefillWorker("p0", pe, lambda rel: KVSender(pe.kv.buffers, specs, "tiny", cfg, rel))
    receiver = KVReceiver(de.kv.buffers, list(de.kv.specs.values()), "tiny", cfg)
    worker = DecodeWorker("d0", de, receiver)
    shared = [(7 * i) % 200 + 5 for i in range(64)]
    # 66 and 73 tokens. D's window group holds the first from page (66 - 31) // 4 = 8 on, all a hit
    # at 64 needs ((64 - 31) // 4 = 8): a first prompt of 68 tokens or more would leave D no hit.
    first, second = shared + [9, 8], shared + [11] * 9

    async def decoded(
        rid: str, prompt: list[int], p_window_from: int, p_cached: int
    ) -> tuple[list[int], dict[str, int]]:
        req = GenerateRequest(rid, prompt, greedy(6), time.time())
        pre = await prefill.prefill(req)
        assert pre.ticket is not None
        assert pre.ticket.first_page == {"full": 0, "swa_32": p_window_from}
        assert pre.num_cached_tokens == p_cached  # P's prefix hit, for the client's usage
        out = [d async for d in worker.decode(req, pre)]
        assert out[-1].finish_reason == "length" and not out[-1].error
        # D's own hit is no prefix hit of the prompt's computation: its deltas say none.
        assert all(d.num_cached_tokens is None for d in out)
        pages = receiver.stats()["last_transfer"]["pages"]
        return [pre.first_token_id] + [t for d in out for t in d.token_ids], pages

    async def local(rid: str, prompt: list[int]) -> list[int]:
        req = GenerateRequest(rid, prompt, greedy(6), time.time())
        return [t async for d in worker.generate(req) for t in d.token_ids]

    async def main() -> None:
        # P's last chunk started at token 48 (chunks of 24): its window from page (48-31)//4 = 4.
        tokens, pages = await decoded("a", first, 4, 0)
        # 17 prompt pages; the window group's from page 8 on, where D's first step reads.
        assert pages == {"full": 17, "swa_32": 9}
        # D kept the first prompt's pages: the shared 64 tokens (16 pages) hit in both groups.
        # (P's own hit: its only chunk starts at 64, its window from page (64-31)//4 = 8.)
        tokens2, pages2 = await decoded("b", second, 8, 64)
        assert pages2 == {"full": 3, "swa_32": 3}
        await wait_until_no_page_held(worker)
        assert tokens == await local("a-local", first)
        assert tokens2 == await local("b-local", second)
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()
        prefill.close()


@pytest.mark.timeout(120)
def test_the_decode_workers_own_prefix_hit_comes_from_its_host_tier() -> None:
    """D pulls only what it does not hold: pages of an earlier turn that its device pool evicted
    are loaded back from its host tier, and the tokens are those of one engine doing it all."""
    cfg = TransceiverConfig(secret="test-secret", lease_s=30.0)
    pe, de = tiny_engine(64), tiny_engine(16, host_pages=32)  # D: 15 device pages of 4 tokens
    assert de.kv.host_tier is not None and de.kv.host_tier.pools["full"].num_pages == 32
    from prefill_worker.worker import PrefillWorker
    from transfer import KVSender

    specs = list(pe.kv.specs.values())
    prefill = PrefillWorker("p0", pe, lambda rel: KVSender(pe.kv.buffers, specs, "tiny", cfg, rel))
    receiver = KVReceiver(de.kv.buffers, list(de.kv.specs.values()), "tiny", cfg)
    worker = DecodeWorker("d0", de, receiver)
    first = list(range(1, 25))  # 6 pages
    second = first + list(range(30, 38))  # 8 pages: D holds the first 6 (on host by then)

    async def disaggregated(rid: str, prompt: list[int]) -> list[int]:
        req = GenerateRequest(rid, prompt, greedy(3), time.time())
        pre = await prefill.prefill(req)
        tokens = [pre.first_token_id]
        async for d in worker.decode(req, pre):
            tokens += d.token_ids
        return tokens

    async def main() -> list[list[int]]:
        out = [await disaggregated("a", first)]
        for i in range(3):  # other prompts push "a"'s pages out of D's device pool
            await disaggregated(f"other-{i}", list(range(40 + 30 * i, 64 + 30 * i)))
        stats = await asyncio.wrap_future(worker.loop.call(lambda e: e.kv.stats()))
        assert stats.groups["full"].host.offloaded >= 6  # type: ignore[union-attr]
        out.append(await disaggregated("b", second))
        await wait_until_no_page_held(worker)
        return out

    try:
        answers = asyncio.run(main())
        host = de.kv.stats().groups["full"].host
        assert host is not None and host.loaded_back >= 1 and host.hit_tokens >= PAGE
        (b,) = [r.metrics for r in de.drain_request_stats() if r.request_id == "b"]
        assert (
            b.num_cached_tokens >= 4 * PAGE and 0 < b.num_cached_host_tokens <= b.num_cached_tokens
        )
        alone = tiny_engine(64)  # the same weights (seeded): one engine doing all of it
        for rid, prompt, got in (("a", first, answers[0]), ("b", second, answers[1])):
            alone.add_request(rid, prompt, greedy(3))
            final = None
            while alone.has_unfinished():
                final = next((o for o in alone.step() if o.finished), final)
            assert final is not None and got == final.token_ids, rid
    finally:
        worker.close()
        prefill.close()
