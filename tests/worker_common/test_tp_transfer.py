"""TPPublisher and TPPuller (worker_common/tp_transfer.py) with real Ray rank actors (the rank
actor of worker_common/tp_ranks.py, its transfer methods as they are, over random KV pools instead
of a model's shard) and real transceivers over loopback: prefill tp 2 to decode tp 2 or 1 (2 KV heads).

The other ranks' answers are awaited on the worker's loop, never blocked on, and a rank that does
not answer in time fails the publish; a request's transfer shows as one record joined over the
ranks (bytes of every rank), and the counters cover every rank."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import ray
import torch
from ray.exceptions import ActorUnavailableError

from prefill_worker.worker import PrefillWorker
from tests.cluster.cluster_fixtures import local_ray
from tests.ports import free_fixed_port
from tests.prefill_worker.test_prefill_worker import wait_until_no_page_held
from tests.tiny_engine import greedy, tiny_engine
from tests.transfer.conftest import MODEL, KVSide, config, specs
from transfer import KVReceiver, KVSender
from worker_common.messages import GenerateRequest
from worker_common.tp_pull import TPPuller
from worker_common.tp_ranks import _TPRankActor
from worker_common.tp_transfer import TPPublisher, plan_reads

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PAGES = 32
TOKENS = 10  # 3 pages of 4
PAGE_BYTES = 3 * 2 * 4 * 2 * 8 * 4  # layers, key/value, tokens, kv heads, head dim, float32


class _PoolRank(_TPRankActor):
    """Rank 1 of a worker: the rank actor's transfer methods over random pools of its own (no
    model); ``publish_delay_s`` holds its publish answers back, as a slow or hung rank does."""

    def __init__(self, seed: int, publish_delay_s: float = 0.0, pull_delay_s: float = 0.0) -> None:
        self.name = f"pool rank {seed}"
        self._init_transfer()
        side = KVSide(specs(num_pages=PAGES), seed)
        self._follower = SimpleNamespace(buffers=side.kv.buffers, specs=side.specs)
        self._ready.set()
        self.publish_delay_s = publish_delay_s
        self.pull_delay_s = pull_delay_s
        self.published = 0

    def publish(self, *args: Any) -> Any:
        time.sleep(self.publish_delay_s)
        ticket = super().publish(*args)
        self.published += 1
        return ticket

    def leases_held(self) -> tuple[int, int]:
        """(publishes answered, leases held now)."""
        return self.published, len(self._sender.leases)

    def pull(self, *args: Any) -> Any:
        time.sleep(self.pull_delay_s)  # (a rank whose transfer loop is stuck)
        return super().pull(*args)

    def pages(self, page_ids: list[int]) -> torch.Tensor:
        return self._follower.buffers["full"][page_ids].clone()


PoolRank = ray.remote(_PoolRank)


@pytest.fixture(scope="module", autouse=True)
def ray_local() -> Iterator[None]:
    with local_ray("tp-transfer"):
        yield


def rank_actor(seed: int, publish_delay_s: float = 0.0, pull_delay_s: float = 0.0) -> Any:
    return PoolRank.options(num_cpus=0, max_concurrency=100).remote(
        seed, publish_delay_s, pull_delay_s
    )


def puller(d_side: KVSide, rank: Any, lost: list[str] | None = None, **cfg: Any) -> TPPuller:
    """Rank 0's TPPuller over ``d_side`` and decode rank 1 ``rank``; a lost rank goes to ``lost``
    (a worker would exit)."""
    on_lost = (lost if lost is not None else []).append
    own = KVReceiver(d_side.kv.buffers, d_side.specs, MODEL, config(**cfg))
    return TPPuller(own, [rank], config(**cfg), MODEL, on_lost, call_slack_s=0.5)


def publisher(
    side: KVSide,
    rank: Any,
    decode_tp: int = 2,
    call_timeout_s: float = 30.0,
    lease_s: float = 10.0,
    port: int = 0,
) -> TPPublisher:
    cfg = config(lease_s=lease_s, port=port)
    return TPPublisher(
        lambda release: KVSender(side.kv.buffers, side.specs, MODEL, cfg, release),
        [rank],
        plan_reads(2, 2, decode_tp),
        side.release,
        cfg,
        MODEL,
        call_timeout_s,
    )


def wait_until(cond: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_one_record_per_request_over_all_ranks_and_counters_of_every_rank() -> None:
    p_side, d_side = KVSide(specs(num_pages=PAGES), 1), KVSide(specs(num_pages=PAGES), 2)
    p_rank, d_rank = rank_actor(3), rank_actor(4)
    pub = publisher(p_side, p_rank)
    pull = puller(d_side, d_rank)
    try:
        src = p_side.allocate("r1", TOKENS)
        dst = d_side.allocate("r1", TOKENS)

        async def transfer() -> Any:
            ticket = await pub.publish("r1", src, TOKENS)
            return ticket, await pull.pull(ticket, dst, 0, TOKENS)

        ticket, result = asyncio.run(transfer())
        assert result.ok, result.error
        # Decode rank 0 holds head 0 from prefill rank 0; decode rank 1 head 1 from prefill rank 1.
        # Pages are [pages, kv_heads, layers, 2, page_size, D].
        got = d_side.kv.buffers["full"][dst["full"]]
        want = p_side.kv.buffers["full"][src["full"]]
        assert torch.equal(got[:, 0], want[:, 0])
        got1 = ray.get(d_rank.pages.remote(dst["full"]))
        want1 = ray.get(p_rank.pages.remote(src["full"]))
        assert torch.equal(got1[:, 1], want1[:, 1])
        wait_until(lambda: "r1" in p_side.released)  # every prefill rank's lease ended

        total = 3 * PAGE_BYTES  # every rank's head slice of 3 pages
        (recv,) = pull.drain_transfer_stats()
        assert (recv.request_id, recv.role, recv.ok, recv.bytes) == ("r1", "recv", True, total)
        assert recv.pages == {"full": 3}
        (send,) = pub.drain_transfer_stats()
        assert (send.request_id, send.role, send.ok, send.bytes) == ("r1", "send", True, total)
        assert send.pages == {"full": 3}
        for side in (pub, pull):
            stats = side.stats()
            assert (stats["transfers_ok"], stats["failures"], stats["bytes"]) == (1, 0, total)

        # The same ticket again: every prefill rank refuses its part (the leases ended).
        again = asyncio.run(pull.pull(ticket, dst, 0, TOKENS))
        assert not again.ok
        assert "decode rank 0 (heads 0..0)" in again.error
        assert "decode rank 1 (heads 1..1)" in again.error
        assert pull.stats()["failures"] == 1
        (failed,) = pull.drain_transfer_stats()
        assert (failed.request_id, failed.ok, failed.bytes) == ("r1", False, 0)

        def refused_on_both_ranks() -> bool:  # rank 1's counters land one stats call late
            return pub.stats()["refused_pulls"] == 2

        wait_until(refused_on_both_ranks)
    finally:
        pull.close()
        pub.close()


def test_with_a_fixed_transfer_port_rank_r_listens_on_port_plus_r() -> None:
    """transfer.port for a firewall: the ranks of one worker share its node, so rank r takes
    port + r, and the ticket's parts say where each listens."""
    port = free_fixed_port()
    side = KVSide(specs(num_pages=PAGES), 5)
    pub = publisher(side, rank_actor(6), port=port)
    try:
        ticket = asyncio.run(pub.publish("r0", side.allocate("r0", TOKENS), TOKENS))
        assert sorted({p.ticket.port for p in ticket.parts}) == [port, port + 1]
    finally:
        pub.close()


def test_a_slow_rank_is_awaited_without_blocking_the_loop() -> None:
    """Rank 1 answers its publish after 1.5 s: meanwhile the worker's loop runs on."""
    p_side = KVSide(specs(num_pages=PAGES), 5)
    pub = publisher(p_side, rank_actor(6, publish_delay_s=1.5), decode_tp=1)
    try:
        src = p_side.allocate("r2", TOKENS)

        async def publish_while_ticking() -> tuple[Any, int]:
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.05)
                    ticks += 1

            ticker = asyncio.ensure_future(tick())
            ticket = await pub.publish("r2", src, TOKENS)
            ticker.cancel()
            return ticket, ticks

        ticket, ticks = asyncio.run(publish_while_ticking())
        assert [(p.decode_rank, p.head_start, p.head_count) for p in ticket.parts] == [
            (0, 0, 1),
            (0, 1, 1),
        ]
        assert ticks >= 10, ticks  # a blocked loop would not have ticked at all
        assert asyncio.run(pub.cancel("r2"))  # both ranks' leases, awaited likewise
        wait_until(lambda: "r2" in p_side.released)
    finally:
        pub.close()


def test_a_decode_rank_whose_pull_outlasts_its_deadlines_is_lost() -> None:
    """Decode rank 1's pull does not end within the transfer deadlines (its loop stuck): rank 0
    stops waiting and reports the rank lost (the worker would go down: the rank may still write
    the pages, which must not go to another request), and the pull fails."""
    p_side, d_side = KVSide(specs(num_pages=PAGES), 11), KVSide(specs(num_pages=PAGES), 12)
    pub = publisher(p_side, rank_actor(13))
    lost: list[str] = []
    deadlines = dict(connect_deadline_s=0.3, pull_deadline_s=0.3, chunk_deadline_s=0.2)
    pull = puller(d_side, rank_actor(14, pull_delay_s=8.0), lost, done_deadline_s=0.2, **deadlines)
    try:
        src, dst = p_side.allocate("r9", TOKENS), d_side.allocate("r9", TOKENS)

        async def transfer() -> Any:
            ticket = await pub.publish("r9", src, TOKENS)
            return await pull.pull(ticket, dst, 0, TOKENS)

        result = asyncio.run(transfer())  # (before the rank's 8 s are up: see ``lost``)
        assert not result.ok and "TimeoutError" in (result.error or "")
        # connect 0.3 + P's answer 0.3 + 3 chunks (10 tokens of 8) * 0.2 + done 0.2 + call 0.5
        assert lost == ["decode rank 1's pull did not end within 1.9s"]
    finally:
        pull.close()
        pub.close()


def test_a_rank_that_does_not_answer_in_time_fails_the_publish() -> None:
    """Rank 1 answers after 1 s, past the 0.5 s call timeout: the publish raises, rank 0's lease
    is given up, and the pages are the worker's to free (the release callback is not called).
    Rank 1's lease, published late, is ended then: it held the request id until it expired, so
    the request published again there (a retry) was refused as already published."""
    p_side = KVSide(specs(num_pages=PAGES), 7)
    rank = rank_actor(8, publish_delay_s=1.0)
    pub = publisher(p_side, rank, decode_tp=1, call_timeout_s=0.5, lease_s=60.0)
    try:
        src = p_side.allocate("r3", TOKENS)
        with pytest.raises(TimeoutError, match="did not answer within 0.5s"):
            asyncio.run(pub.publish("r3", src, TOKENS))
        assert len(pub.own.leases) == 0
        # (published late, then ended: not held until lease_s)
        wait_until(lambda: ray.get(rank.leases_held.remote(), timeout=30) == (1, 0))
        assert p_side.released == []
        p_side.free("r3")
        # The request again, on rank 1 alone (its lease of the first publish is gone).
        again = ray.get(rank.publish.remote("r3|d0", src, TOKENS, (1, 1)), timeout=30)
        assert ray.get(rank.cancel.remote("r3|d0", again.lease_gen - 1), timeout=30) is False
        assert ray.get(rank.cancel.remote("r3|d0", again.lease_gen), timeout=30) is True
    finally:
        pub.close()


def test_a_part_never_pulled_fails_the_requests_one_record() -> None:
    """Decode tp 1 reads head 0 from prefill rank 0 and head 1 from prefill rank 1 (the same sub-id
    on both ranks). Only rank 0's part is pulled: once rank 1's lease expires the pages go back,
    and the request's one record is a failure naming rank 1's part; rank 1's expiry is counted."""
    p_side, d_side = KVSide(specs(num_pages=PAGES), 9), KVSide(specs(num_pages=PAGES), 10)
    pub = publisher(p_side, rank_actor(11), decode_tp=1, lease_s=1.0)
    receiver = KVReceiver(d_side.kv.buffers, d_side.specs, MODEL, config())
    try:
        src = p_side.allocate("r4", TOKENS)
        dst = d_side.allocate("r4", TOKENS)
        ticket = asyncio.run(pub.publish("r4", src, TOKENS))
        part = ticket.parts[0]
        assert (part.decode_rank, part.head_start, part.head_count) == (0, 0, 1)
        assert receiver.pull_blocking(part.ticket, dst, 0, TOKENS, (0, 1)).ok
        wait_until(lambda: "r4" in p_side.released)
        (send,) = pub.drain_transfer_stats()
        assert (send.request_id, send.ok, send.bytes) == ("r4", False, 3 * PAGE_BYTES // 2)
        assert "prefill rank 1 for decode rank 0: its lease ended unserved" in send.error
        wait_until(lambda: pub.stats()["expired_leases"] == 1)
        stats = pub.stats()
        assert (stats["transfers_ok"], stats["failures"]) == (0, 1)
        d_side.free("r4")
    finally:
        receiver.close()
        pub.close()


def test_a_prefill_cancelled_while_its_ranks_publish_frees_its_pages() -> None:
    """The client goes away while rank 1 has not answered the publish yet: the prefill ends
    cancelled, rank 0's lease is given up and the worker frees the pages (none held after)."""
    engine = tiny_engine(64)
    cfg = config(lease_s=60.0)  # (rank 1's lease must not end by expiring)
    rank = rank_actor(12, publish_delay_s=2.0)

    def make_publisher(release: Any) -> TPPublisher:
        specs_ = list(engine.kv.specs.values())
        return TPPublisher(
            lambda own_release: KVSender(engine.kv.buffers, specs_, MODEL, cfg, own_release),
            [rank],
            plan_reads(engine.model_config.num_kv_heads, 2, 1),
            release,
            cfg,
            MODEL,
        )

    worker = PrefillWorker("p0", engine, make_publisher)

    async def main() -> None:
        req = GenerateRequest("c", list(range(1, 11)), greedy(4), time.time())
        task = asyncio.ensure_future(worker.prefill(req))
        deadline = time.monotonic() + 30
        while "c" not in worker._publishing:
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # rank 0 has published; rank 1 answers in 2 s
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(worker.publisher.own.leases) == 0
        await wait_until_no_page_held(worker)
        # Rank 1's lease, published after the cancel, is ended too (not held until lease_s).
        wait_until(lambda: ray.get(rank.leases_held.remote(), timeout=30) == (1, 0))

    try:
        asyncio.run(main())
    finally:
        worker.close()


def test_more_open_leases_than_the_rank_has_threads() -> None:
    """Rank 1 has 3 threads and 6 requests hold a lease there: each publish is still answered
    (rank 0 keeps one call open per rank for the leases that end, not one per lease), and each
    request's pages are freed once its leases end."""
    p_side = KVSide(specs(num_pages=PAGES), 13)
    rank = PoolRank.options(num_cpus=0, max_concurrency=3).remote(14)
    pub = publisher(p_side, rank, decode_tp=1, call_timeout_s=5.0)
    ids = [f"many-{i}" for i in range(6)]
    try:

        async def publish_all() -> None:
            for rid in ids:
                await pub.publish(rid, p_side.allocate(rid, TOKENS), TOKENS)

        asyncio.run(publish_all())
        for rid in ids:
            assert asyncio.run(pub.cancel(rid))
        wait_until(lambda: sorted(p_side.released) == sorted(ids))
    finally:
        pub.close()


def test_a_lost_rank_fails_its_open_parts_and_the_pages_are_freed() -> None:
    """Rank 1 dies while a request's leases are open: its part can never end by a notice, so it
    fails at once, rank 0's lease is still given up by its expiry, and the pages go back; the
    request's record names the lost rank."""
    p_side = KVSide(specs(num_pages=PAGES), 15)
    rank = rank_actor(16)
    pub = publisher(p_side, rank, decode_tp=1, lease_s=1.0)
    try:
        asyncio.run(pub.publish("lost", p_side.allocate("lost", TOKENS), TOKENS))
        ray.kill(rank, no_restart=True)
        wait_until(lambda: "lost" in p_side.released)
        (send,) = pub.drain_transfer_stats()
        assert not send.ok and "the rank was lost" in send.error, send
    finally:
        pub.close()


class _CallLostRank(_PoolRank):
    """A rank alive and well whose calls Ray reports lost on the way, once each
    (ActorUnavailableError: "the task may or may not have been executed"): ``released`` while
    it holds a lease, and ``pull`` (after its pull has started: it may still write)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.lost_calls: set[str] = set()

    def _lose(self, call: str) -> None:
        self.lost_calls.add(call)
        raise ActorUnavailableError(f"{call}: the call was lost on the way (test)", None)

    def released(self, wait_s: float) -> Any:
        held = self._sender is not None and self._sender.stats()["leases"]
        if held and "released" not in self.lost_calls:
            self._lose("released")
        return super().released(wait_s)

    def pull(self, *args: Any) -> Any:
        if "pull" not in self.lost_calls:
            self._lose("pull")
        return super().pull(*args)


CallLostRank = ray.remote(_CallLostRank)


def test_a_lost_released_call_is_not_a_lost_rank() -> None:
    """Prefill tp 2 to decode tp 1: rank 0's part is pulled, rank 1's lease waits; Ray loses a
    ``released`` call to rank 1 while that lease is open. The rank is alive and its lease may
    still be read: the pages stay held until it ends (its expiry, which rank 1 then reports),
    and rank 1 is asked again, so a later request's pages come back too."""
    p_side, d_side = KVSide(specs(num_pages=PAGES), 17), KVSide(specs(num_pages=PAGES), 18)
    rank = CallLostRank.options(num_cpus=0, max_concurrency=100).remote(19)
    pub = publisher(p_side, rank, decode_tp=1, lease_s=6.0)  # (past one released wait of 5 s)
    receiver = KVReceiver(d_side.kv.buffers, d_side.specs, MODEL, config())
    try:
        for rid in ("r", "s"):
            src, dst = p_side.allocate(rid, TOKENS), d_side.allocate(rid, TOKENS)
            ticket = asyncio.run(pub.publish(rid, src, TOKENS))
            assert receiver.pull_blocking(ticket.parts[0].ticket, dst, 0, TOKENS, (0, 1)).ok
            wait_until(lambda rid=rid: rid in p_side.released, timeout_s=30)
            expired = ray.get(rank.transfer_counters.remote(), timeout=30).expired_leases
            assert expired == ("r", "s").index(rid) + 1  # freed only once rank 1's lease ended
            (send,) = pub.drain_transfer_stats()
            assert "its lease ended unserved" in send.error and "lost" not in send.error
            d_side.free(rid)
        assert ray.get(rank.__ray_call__.remote(lambda a: a.lost_calls)) == {"released"}
    finally:
        receiver.close()
        pub.close()


def test_a_lost_pull_call_takes_the_decode_worker_down() -> None:
    """Ray loses rank 1's pull call (the rank alive, its pull perhaps still writing the pages):
    the pull fails only with the rank reported lost (the worker goes down), never as a plain
    failure after which the worker would free pages the rank may still write."""
    p_side, d_side = KVSide(specs(num_pages=PAGES), 20), KVSide(specs(num_pages=PAGES), 21)
    pub = publisher(p_side, rank_actor(22), lease_s=2.0)
    lost: list[str] = []
    rank = CallLostRank.options(num_cpus=0, max_concurrency=100).remote(23)
    pull = puller(d_side, rank, lost)
    try:
        src, dst = p_side.allocate("r", TOKENS), d_side.allocate("r", TOKENS)

        async def transfer() -> Any:
            ticket = await pub.publish("r", src, TOKENS)
            return await pull.pull(ticket, dst, 0, TOKENS)

        result = asyncio.run(transfer())
        assert not result.ok
        assert len(lost) == 1 and "decode rank 1's pull call was lost" in lost[0], lost
    finally:
        pull.close()
        pub.close()
