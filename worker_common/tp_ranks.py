"""Ranks 1..tp-1 of a tensor-parallel cluster worker, as Ray actors in the worker's placement group.

Rank 0 is the worker actor itself (prefill or decode): it owns the scheduler, the page accounting,
the transceiver and the sampling. While building its engine it starts the other ranks here, in
bundles 1..tp-1 of the placement group the builder made for the worker (all on one node, so the
ranks meet on 127.0.0.1). Rank 0 owns these actors: when it dies, Ray ends them with it, and a
restarted rank 0 starts fresh ones. A rank whose loop fails exits its process, so rank 0's next
collective raises and the whole worker goes down (worker_common/tp_failure.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.cpu_share import apply_cpu_share
from engine.engine_config import EngineConfig
from engine.tp.comm import TPGroup, open_store, wait_arrivals
from transfer import TransceiverConfig, TransferResult
from transfer.messages import TransferTicket
from transfer.stats import TransferCounters, TransferStats
from worker_common.engine_setup import NOSET_VISIBLE_DEVICES, gpu_device
from worker_common.tp_transfer_stats import counters_of

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # a rank's model load and pools, before its transfer can start
WATCH_INTERVAL_S = 0.5  # how often rank 0 checks that every other rank is alive
WATCH_TIMEOUT_S = 30.0  # a rank that does not answer in this time counts as lost
RECORDS_KEPT = 10_000  # served pulls' records whose lease has not ended yet


@dataclass(frozen=True)
class LeaseEnded:
    """A rank's lease that ended, with the record of the pull that served it (None: none did)."""

    sub: str
    record: TransferStats | None


class _TPRankActor:
    """Rank ``rank`` > 0: builds its TPFollower (weights and KV head shard) and runs its loop on
    a thread of its own (the actor stays responsive to ``ping``)."""

    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        size: int,
        port: int,
        num_cpus: float | None,
        log_level: str,
        worker_id: str,
    ) -> None:
        logging.basicConfig(level=log_level)
        self.name = f"{worker_id} rank {rank}"
        device = gpu_device() if torch.device(config.device).type == "cuda" else config.device
        config = dataclasses.replace(config, device=device)
        apply_cpu_share(num_cpus, device)
        self._follower: Any = None
        self._init_transfer()
        self._thread = threading.Thread(
            target=self._run, args=(config, rank, size, port, device), daemon=True, name=self.name
        )
        self._thread.start()

    def _run(self, config: EngineConfig, rank: int, size: int, port: int, device: str) -> None:
        from engine.tp.follower import TPFollower

        try:
            self._follower = TPFollower(config, rank, size, port, device)
            self._ready.set()
            self._follower.run()
        except BaseException:
            log.exception("%s failed; its worker goes down with it", self.name)
            os._exit(1)

    def ping(self) -> bool:
        return self._thread.is_alive()

    # ---- the KV transfer of this rank's pools (worker_common/tp_transfer.py) ----
    def _init_transfer(self) -> None:
        self._ready = threading.Event()  # set once ``_follower`` holds the pools
        self._sender: Any = None
        self._receiver: Any = None
        self._lock = threading.Lock()
        self._lease_ended = threading.Condition(self._lock)
        self._ended: list[LeaseEnded] = []  # not yet handed to rank 0 (``released``)
        self._records: dict[str, TransferStats] = {}  # sub id -> its served pull's record

    def _pools(self) -> tuple[Any, list[Any]]:
        if not self._ready.wait(READY_TIMEOUT_S):
            raise RuntimeError(f"{self.name}: its pools were not ready in {READY_TIMEOUT_S}s")
        return self._follower.buffers, self._follower.specs

    def start_sender(self, config: TransceiverConfig, model: str) -> None:
        from transfer import KVSender

        buffers, specs = self._pools()
        # (config.port is this rank's own: the ranks of a worker share a node; tp_transfer.py)
        self._sender = KVSender(buffers, specs, model, config, self._on_released)

    def _on_released(self, sub: str) -> None:
        # The sender records a served pull before it ends the lease: the record is there now.
        # Drained under the lock: leases end on the transceiver's loop and in cancel calls on
        # Ray's threads, and a record drained by one and stored after the other looked for it
        # would be lost (its pull counted as failed).
        with self._lock:
            for record in self._sender.drain_transfer_stats():
                self._records[record.request_id] = record
            while len(self._records) > RECORDS_KEPT:  # (a record whose lease never ended)
                self._records.pop(next(iter(self._records)))
            self._ended.append(LeaseEnded(sub, self._records.pop(sub, None)))
            self._lease_ended.notify_all()

    def publish(
        self, sub: str, page_ids: dict[str, list[int]], declared: int, heads: tuple[int, int]
    ) -> TransferTicket:
        return self._sender.publish(sub, page_ids, declared, heads)

    def released(self, wait_s: float) -> list[LeaseEnded]:
        """The leases that ended since the last call (rank 0 frees the pages once all of a
        request's have); waits up to ``wait_s`` for one. Rank 0 keeps one such call open per
        rank, however many leases are: a call per lease would hold one of the actor's threads
        each, and a thousand open leases would leave none for ``publish``."""
        with self._lock:
            self._lease_ended.wait_for(lambda: bool(self._ended), wait_s)
            ended, self._ended = self._ended, []
        return ended

    def transfer_counters(self) -> TransferCounters:
        """This rank's transceiver counters (rank 0 sums them over the ranks)."""
        side = self._sender if self._sender is not None else self._receiver
        return counters_of(side.stats()) if side is not None else TransferCounters()

    def cancel(self, sub: str, lease_gen: int | None = None) -> bool:
        return self._sender.cancel(sub, lease_gen)

    def start_receiver(self, config: TransceiverConfig, model: str) -> None:
        from transfer import KVReceiver

        buffers, specs = self._pools()
        self._receiver = KVReceiver(buffers, specs, model, config)

    def pull(
        self,
        ticket: TransferTicket,
        dst_page_ids: dict[str, list[int]],
        skip_pages: int | dict[str, int],
        expected_prompt_len: int,
        heads: tuple[int, int],
    ) -> TransferResult:
        return self._receiver.pull_blocking(
            ticket, dst_page_ids, skip_pages, expected_prompt_len, heads
        )


TPRankActor = ray.remote(_TPRankActor)


def take_worker_down(worker_id: str, problem: str) -> None:
    """The worker cannot go on (a rank lost: dead, hung, or a pull of its past its deadlines; its
    engine's step failed): rank 0's process exits, so the router sees the worker gone and Ray
    restarts it (with all its ranks) afresh; no page a lost rank may still write is ever handed
    to another request, and no page of a failed engine stays held."""
    log.error("%s: %s; the worker goes down (Ray restarts it)", worker_id, problem)
    logging.shutdown()
    os._exit(1)


class _StartWatch:
    """Rank 0's watch on ranks 1.. until they join its group (engine.tp.comm.wait_arrivals): one
    ping in flight per rank, a new one once the last answered. A rank that died before joining
    (its actor failed to start, or its process exited) is named at once: rank 0 waited out the
    group's timeout (300 s) for it."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors
        self.pings = [a.ping.remote() for a in actors]

    def problem(self) -> str:
        answered, _ = ray.wait(self.pings, num_returns=len(self.pings), timeout=0)
        for rank, ping in enumerate(self.pings, 1):
            if ping not in answered:
                continue
            try:
                alive = ray.get(ping)
            except Exception as e:  # RayActorError: the rank's actor or process is gone
                said = (str(e).strip().splitlines() or [""])[0]  # (Ray's first line: the cause)
                return f"tensor-parallel rank {rank} died at start-up ({type(e).__name__}: {said})"
            if not alive:
                return f"tensor-parallel rank {rank}'s loop ended at start-up"
            self.pings[rank - 1] = self.actors[rank - 1].ping.remote()
        return ""


class RayRanks:
    """Rank 0's handle on ranks 1..size-1 (engine.tp.local_ranks.Ranks)."""

    def __init__(
        self,
        config: EngineConfig,
        size: int,
        worker_id: str,
        num_cpus: float | None,
        num_gpus: float,
        log_level: str,
    ) -> None:
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise RuntimeError(
                f"{worker_id}: a tensor-parallel worker's rank 0 must run in its placement group "
                "(cluster/builder.py makes one per worker)"
            )
        store = open_store()
        options: dict[str, object] = {
            "num_cpus": num_cpus if num_cpus is not None else 1.0,
            "num_gpus": num_gpus,
            "max_restarts": 0,  # a rank never comes back alone: its worker restarts whole
            # ping, publish, cancel, and one thread per pull and per lease being waited on
            "max_concurrency": 1000,
        }
        if os.environ.get(NOSET_VISIBLE_DEVICES) == "1":
            options["runtime_env"] = {"env_vars": {NOSET_VISIBLE_DEVICES: "1"}}
        self.actors = [
            TPRankActor.options(
                **options,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=rank
                ),
            ).remote(config, rank, size, store.port, num_cpus, log_level, worker_id)
            for rank in range(1, size)
        ]
        self._closing = threading.Event()
        try:
            wait_arrivals(store, size, _StartWatch(self.actors).problem)
            self.group = TPGroup.connect(
                0, size, store.port, torch.device(config.device), store=store
            )
        except BaseException:
            self.kill()
            raise
        self._watch = threading.Thread(
            target=self._watch_ranks, args=(worker_id,), daemon=True, name=f"{worker_id} tp watch"
        )
        self._watch.start()

    def _watch_ranks(self, worker_id: str) -> None:
        """A rank that dies takes its worker down as a whole: rank 0's process exits, so the
        router sees the worker gone (its in-flight calls fail, it stops sending) and Ray restarts
        rank 0, which starts all other ranks afresh (the old ones die with their owner)."""
        while not self._closing.wait(WATCH_INTERVAL_S):
            try:
                alive = ray.get([a.ping.remote() for a in self.actors], timeout=WATCH_TIMEOUT_S)
                problem = None if all(alive) else "a tensor-parallel rank's loop ended"
            except Exception as e:  # RayActorError, a timeout: the rank is gone or hung
                problem = f"a tensor-parallel rank lost: {type(e).__name__}: {e}"
            if problem is not None and not self._closing.is_set():
                take_worker_down(worker_id, problem)

    def close(self) -> None:
        self._closing.set()
        try:
            self.group.broadcast_object(None)
        except Exception:  # a rank already gone: nothing to tell
            log.warning("tensor-parallel ranks did not take the stop message", exc_info=True)
        finally:
            self.kill()

    def kill(self) -> None:
        self._closing.set()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)

    def stop_after_failure(self, wait: bool) -> str:
        """(The worker goes down after a failed step whatever this says: take_worker_down.)"""
        self.kill()
        return ""
