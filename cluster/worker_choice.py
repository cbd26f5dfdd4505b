"""The router's choice of workers: its view of each worker (WorkerSlot) and the policies that pick
one (``router.policy``; conditional disaggregation's local prefill). Pure over the slots: no actor
is called to choose.

``kv_aware`` (Dynamo's KV router): the choice weighs each worker's cached blocks from its KV events
(cluster/kv_index.py) and takes the worker with the least cost = prompt tokens it would compute +
HOST_HIT_WEIGHT x tokens it would load back from its host tier + the load this router put on it:
prefill tokens in flight there (less the part this prompt shares, which it computes once) and the
context tokens of the requests streaming from it (Dynamo's active decode blocks; in aggregated mode
a worker holding a popular prefix would otherwise take every request while the others idle).
A prompt sent to a worker counts as cached there from that moment (``WorkerSlot.pending``) until
its prefill ends, when the worker's KV events say what it holds: requests sharing a new prefix (a
burst, the ``n`` choices of one prompt) go where it is being computed, not once per worker.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import ActorDiedError, RayTaskError

from cluster.kv_index import KVIndex
from kvcache.block_hash import hash_full_pages
from worker_common.messages import GenerateRequest, WorkerStats

# Cost of a prompt token a worker would load back from its host tier, in tokens it would compute:
# a load-back is a copy (host to device), far cheaper than computing the token, yet it takes copy
# time and device pages. 0.5 is a middle, not a measured figure.
HOST_HIT_WEIGHT = 0.5


@dataclass
class WorkerSlot:
    """The router's view of one worker actor."""

    worker_id: str
    handle: Any  # ray ActorHandle
    outstanding: int = 0
    free_pages: int = 0
    healthy: bool = True
    # Ray reported it dead for good (ActorDiedError: its restarts are spent; one it restarts
    # fails its calls with ActorUnavailableError): never picked again, nothing waits for it.
    dead: bool = False
    failures: int = 0
    last_stats: WorkerStats | None = None  # the last stats poll's answer
    queued_prefill_tokens: int = 0  # prompt tokens sent here to compute, not answered yet
    num_prefills: int = 0  # prefills sent here (kv_aware spreads equal costs by it)
    active_tokens: int = 0  # context tokens of the requests streaming from it
    # block hashes of the prompts sent here whose prefill has not ended (each prompt's once)
    pending: collections.Counter[int] = field(default_factory=collections.Counter)


class NoLiveDecodeWorker(RuntimeError):
    """Every decode worker is dead for good: no request can be served."""


def note_unavailable(w: WorkerSlot, error: Exception) -> None:
    """A call to ``w`` failed as Ray's RayActorError: unhealthy until its stats answer again,
    dead for good on ActorDiedError (Ray restarts a worker with restarts left, and its calls
    fail meanwhile with ActorUnavailableError)."""
    w.healthy = False
    # (an ActorDiedError the worker's own call raised, one of its ranks', is a task's error)
    if isinstance(error, ActorDiedError) and not isinstance(error, RayTaskError):
        w.dead = True


class WorkerChoice:
    """Which prefill or decode worker takes a request, by ``policy`` (load_balance, round_robin,
    prefix_aware, kv_aware) over the same slot lists the router holds."""

    def __init__(
        self,
        prefill: list[WorkerSlot],
        decode: list[WorkerSlot],
        policy: str,
        page_size: int,
        kv_index: KVIndex | None,
        local_prefill_max_tokens: int,
    ) -> None:
        if kv_index is None and (policy == "kv_aware" or local_prefill_max_tokens):
            raise ValueError("kv_aware routing and local_prefill_max_tokens need a KVIndex")
        self.prefill = prefill
        self.decode = decode
        self.policy = policy
        self.page_size = page_size
        self.kv_index = kv_index
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self._turn = 0  # round_robin position

    # ---- what workers have cached ----
    def block_hashes(self, req: GenerateRequest) -> list[int] | None:
        """The prompt's block hashes, as far as a worker's prefix hit can reach (one token is
        always computed), when the router indexes the workers' caches."""
        # (a request scoring its prompt reads no cache: every worker would compute all of it)
        if self.kv_index is None or req.sampling.prompt_logprobs is not None:
            return None
        tokens = req.prompt_token_ids.tolist()
        return hash_full_pages(tokens[: len(tokens) - 1], self.page_size)

    def claim(self, w: WorkerSlot, hashes: list[int] | None) -> None:
        """The prompt of ``hashes`` is being prefilled on ``w`` (``release`` when that ends)."""
        if hashes:
            w.pending.update(hashes)

    def release(self, w: WorkerSlot, hashes: list[int] | None) -> None:
        if hashes:
            w.pending.subtract(hashes)
            for h in hashes:
                if w.pending[h] <= 0:
                    del w.pending[h]

    def _held(self, w: WorkerSlot, hashes: list[int] | None) -> tuple[int, int, int]:
        """(device, host) prompt tokens ``w`` holds by its KV events, and the tokens of the
        prompt's prefix that prompts sent to ``w`` are computing there now."""
        if hashes is None:
            return 0, 0, 0
        device = host = 0
        if self.kv_index is not None:
            c = self.kv_index.cached_prefix(w.worker_id, hashes, self.page_size)
            device, host = c.device_pages * self.page_size, c.host_pages * self.page_size
        pending = 0
        for h in hashes:
            if not w.pending[h]:
                break
            pending += self.page_size
        return device, host, pending

    @staticmethod
    def _merged(device: int, host: int, pending: int) -> tuple[int, int]:
        """(device, host) tokens with a prefix being computed counted on the device."""
        on_device = max(device, pending)
        return on_device, max(device + host, pending) - on_device

    def cached_tokens(self, w: WorkerSlot, hashes: list[int] | None) -> tuple[int, int]:
        """(device, host) prompt tokens ``w`` holds, by its KV events, or is computing for a
        prompt sent there before (device)."""
        return self._merged(*self._held(w, hashes))

    def tokens_to_compute(
        self, w: WorkerSlot, req: GenerateRequest, hashes: list[int] | None
    ) -> int:
        """Prompt tokens ``w`` would compute for ``req``: those it holds on neither tier."""
        return len(req.prompt_token_ids) - sum(self.cached_tokens(w, hashes))

    def prefill_cost(self, w: WorkerSlot, n_prompt: int, hashes: list[int] | None) -> float:
        """kv_aware's cost of prefilling a prompt of ``n_prompt`` tokens on ``w`` (module doc)."""
        indexed_device, indexed_host, pending = self._held(w, hashes)
        device, host = self._merged(indexed_device, indexed_host, pending)
        # (what w computes of this prompt for the prompts before it is queued there once)
        shared = max(0, pending - indexed_device - indexed_host)
        queued = max(0, w.queued_prefill_tokens - shared)
        return n_prompt - device - host + HOST_HIT_WEIGHT * host + queued + w.active_tokens

    # ---- choosing workers ----
    def pick_prefill(
        self, req: GenerateRequest, exclude: set[str], hashes: list[int] | None = None
    ) -> WorkerSlot | None:
        """The healthy prefill worker not in ``exclude`` that the policy names; None when none."""
        live = [w for w in self.prefill if w.healthy and not w.dead and w.worker_id not in exclude]
        return self._pick(live, req, hashes) if live else None

    def _pick(
        self, live: list[WorkerSlot], req: GenerateRequest, hashes: list[int] | None
    ) -> WorkerSlot:
        """Of ``live`` (not empty), the worker ``policy`` names to prefill ``req``."""
        if self.policy == "round_robin":
            self._turn += 1
            return live[self._turn % len(live)]
        if self.policy == "kv_aware":
            n = len(req.prompt_token_ids)
            return min(
                live,
                key=lambda w: (self.prefill_cost(w, n, hashes), w.outstanding, w.num_prefills),
            )
        least = min(w.outstanding for w in live)
        if self.policy == "prefix_aware" and len(req.prompt_token_ids) >= self.page_size:
            # Requests sharing their first page go to the same worker (its prefix cache has it),
            # unless that worker is clearly busier than the least loaded one. Rendezvous hashing:
            # a worker leaving (or back) moves only the prefixes that prefer it.
            first = req.prompt_token_ids.packed[: 4 * self.page_size]
            preferred = max(
                live,
                key=lambda w: hashlib.blake2b(first + w.worker_id.encode(), digest_size=8).digest(),
            )
            if preferred.outstanding <= least + 2:
                return preferred
        return min(live, key=lambda w: w.outstanding)

    def live_decode(self) -> list[WorkerSlot]:
        """The healthy decode workers, or all those not dead for good when none is (one may be
        back by now). NoLiveDecodeWorker when every one is dead for good."""
        alive = [w for w in self.decode if not w.dead]
        if not alive:
            raise NoLiveDecodeWorker(
                f"every decode worker is dead (Ray restarts none of "
                f"{', '.join(w.worker_id for w in self.decode)} again)"
            )
        return [w for w in alive if w.healthy] or alive

    def pick_aggregated(self, req: GenerateRequest, hashes: list[int] | None) -> WorkerSlot:
        """Aggregated mode: the decode worker that prefills ``req`` too, as the policy says."""
        return self._pick(self.live_decode(), req, hashes)

    def pick_decode(self, hashes: list[int] | None = None) -> WorkerSlot:
        """The decode worker to take a prefilled request: the fewest running requests, then the
        most of its prompt cached, then the most free pages."""
        return min(
            self.live_decode(),
            key=lambda w: (w.outstanding, -sum(self.cached_tokens(w, hashes)), -w.free_pages),
        )

    def local_prefill_worker(
        self, req: GenerateRequest, hashes: list[int] | None
    ) -> WorkerSlot | None:
        """The decode worker to prefill ``req`` itself (conditional disaggregation), or None."""
        if not self.local_prefill_max_tokens or not self.prefill:
            return None
        d = self.pick_decode(hashes)
        return (
            d if self.tokens_to_compute(d, req, hashes) <= self.local_prefill_max_tokens else None
        )
