"""build_cluster: create the collector, prefill and decode actors, and wait until they are healthy.

Fails early: a worker that cannot start (bad model path, no resources on any node, a crash while
loading) ends the build with a message naming the worker and the cause, and every actor already
created is killed, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.collector import expected_roles_for
from cluster.collector_actor import start_collector_actor
from cluster.config import ClusterConfig
from cluster.kv_index import KVIndex
from cluster.preflight import preflight
from cluster.router import Router
from cluster.transfer_secret import cluster_secret
from cluster.worker_choice import WorkerSlot
from cluster.worker_specs import worker_spec
from decode_worker.actor import DecodeWorkerActor
from engine.model_config import ModelConfig
from prefill_worker.actor import PrefillWorkerActor
from worker_common.engine_setup import NOSET_VISIBLE_DEVICES
from worker_common.messages import Role

log = logging.getLogger(__name__)


CLOSE_WAIT_S = 10.0  # for every worker's close at a shutdown, together


class ClusterBuildError(RuntimeError):
    """The cluster could not be built; the message says which worker failed and why."""


class BuildStopped(Exception):
    """Building the cluster was stopped from outside (`duet serve` got SIGINT or SIGTERM); what
    it had started is stopped."""


@dataclass
class ClusterHandles:
    config: ClusterConfig
    collector: Any
    prefill: list[WorkerSlot] = field(default_factory=list)
    decode: list[WorkerSlot] = field(default_factory=list)
    # One per tensor-parallel worker: its ranks' bundles, packed on one node.
    placement_groups: list[PlacementGroup] = field(default_factory=list)

    def router(self) -> Router:
        """The router over these workers; with a KVIndex of them when it routes by their caches
        (the frontend's KVEventFeed fills it)."""
        routing = self.config.router
        index = None
        if routing.uses_kv_events:
            index = KVIndex([w.worker_id for w in self.prefill + self.decode])
        router = Router(
            self.prefill,
            self.decode,
            policy=routing.policy,
            prefill_retries=routing.prefill_retries,
            local_prefill_fallback=routing.local_prefill_fallback,
            page_size=self.config.kvcache.page_size,
            call_timeout_s=self.config.server.request_timeout_s,
            kv_index=index,
            local_prefill_max_tokens=routing.local_prefill_max_tokens,
        )
        if self.collector is not None:  # (not awaited: metrics are an aid)
            router.close_request = self.collector.close.remote
        return router

    def shutdown(self) -> None:
        """Every worker asked to close (its pages and transceiver given back) at once, waited
        for up to CLOSE_WAIT_S in all (one by one, each worker still loading cost its own wait),
        then every actor killed and every placement group removed, each on its own: one that
        fails (Ray's head gone, say) leaves none of the others behind."""
        workers = [w.handle for w in self.prefill + self.decode]
        closing = []
        for handle in workers:
            with contextlib.suppress(Exception):
                closing.append(handle.close.remote())
        if closing:
            with contextlib.suppress(Exception):
                ray.wait(closing, num_returns=len(closing), timeout=CLOSE_WAIT_S)
        for handle in [*workers, self.collector]:
            if handle is not None:
                try:
                    ray.kill(handle, no_restart=True)
                except Exception as e:
                    log.warning("could not kill %s: %s", handle, e)
        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception as e:
                log.warning("could not remove placement group %s: %s", pg.id, e)


def _actor_options(config: ClusterConfig, role: str, index: int) -> dict[str, Any]:
    pool = config.prefill if role == "prefill" else config.decode
    options: dict[str, Any] = {
        **pool.resources.ray_actor_options,  # num_cpus, num_gpus, resources, label_selector
        "max_restarts": 3,  # a crashed worker comes back (a new UCX address, so new tickets)
        "max_task_retries": 0,  # the router decides about retries, never Ray
        "max_concurrency": 1000,
    }
    direct = config.transfer.direct_copy and not config.aggregated
    if pool.resources.num_gpus > 0 and (direct or pool.tensor_parallel_size > 1):
        # Every GPU of the node visible to the worker (it picks its own by Ray's GPU id), so the
        # decode worker can open the prefill worker's pools through CUDA IPC (transfer/paths/),
        # and a tensor-parallel worker's ranks (which see them all too: worker_common/tp_ranks.py)
        # reach each other's GPUs directly for NCCL.
        options["runtime_env"] = {"env_vars": {NOSET_VISIBLE_DEVICES: "1"}}
    return options


def _rank0_options(handles: ClusterHandles, role: str, index: int) -> dict[str, Any]:
    """The worker actor's options; for a tensor-parallel worker its rank 0 goes to bundle 0 of a
    new placement group of ``tensor_parallel_size`` bundles (STRICT_PACK: one node), where it
    starts the other ranks (worker_common/tp_ranks.py)."""
    config = handles.config
    options = _actor_options(config, role, index)
    pool = config.prefill if role == "prefill" else config.decode
    tp = pool.tensor_parallel_size
    if tp == 1:
        return options
    bundle = pool.resources.bundle
    if not bundle:  # A bundle needs some resource: a rank reserving none takes a sliver of a CPU.
        bundle = {"CPU": 0.01}
        options["num_cpus"] = 0.01
    # The placement group decides the node: the worker's label selector goes to its bundles.
    selector = options.pop("label_selector", None)
    pg = placement_group(
        [dict(bundle) for _ in range(tp)],
        strategy="STRICT_PACK",
        bundle_label_selector=[dict(selector) for _ in range(tp)] if selector else None,
    )
    handles.placement_groups.append(pg)
    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=0
    )
    return options


def start_collector(config: ClusterConfig, name: str) -> Any:
    """The perf-metrics collector actor of ``config``, named ``name`` in the job's namespace."""
    return start_collector_actor(
        expected_roles_for(config.aggregated),
        max_records_per_worker=config.stats.perf_buffer_len,
        max_pending=config.stats.max_pending_joins,
        name=name,
    )


def build_cluster(
    config: ClusterConfig,
    ready_timeout_s: float = 600.0,
    worker_log_level: str | None = None,
    transfer_secret: str | None = None,
    model: ModelConfig | None = None,
    fixed_nodes: bool = False,
    should_stop: Callable[[], bool] = lambda: False,
) -> ClusterHandles:
    """Create every actor of ``config`` in the connected Ray cluster; return when all are healthy.
    ``worker_log_level``: the workers' logging level (default: this process's).
    ``transfer_secret``: the secret the workers' transceivers prove to each other (None: from
    ``transfer.secret`` or DUET_TRANSFER_SECRET, else a fresh one for this cluster).
    ``model``: the model's shape, when read already (preflight.model_of); ``fixed_nodes``: the
    Ray nodes are all there will be (a Ray the caller started here): every worker must fit them.
    ``should_stop``: asked while the workers start; True raises BuildStopped (all stopped).

    Raises ConfigError, before any actor starts, for a tensor_parallel_size the model cannot be
    split by or no node can host, and for a label selector that no node, or too few for the
    replicas, can meet (cluster/preflight.py)."""
    preflight(config, model, fixed_nodes)
    # Handed to the workers inside their TransceiverConfig (it never appears in its repr).
    secret = None if config.aggregated else transfer_secret or cluster_secret(config, make=True)
    # Workers find the collector by this name (a name, not a handle in their constructor
    # arguments: worker_common/actor_base.py says why).
    collector_name = f"duet-collector-{uuid.uuid4().hex[:12]}"
    collector = start_collector(config, collector_name)
    handles = ClusterHandles(config, collector)
    try:
        for i in range(config.prefill.replicas):
            spec = worker_spec(config, Role.PREFILL, i, collector_name, worker_log_level, secret)
            h = PrefillWorkerActor.options(**_rank0_options(handles, "prefill", i)).remote(spec)
            handles.prefill.append(WorkerSlot(spec.worker_id, h))
        for i in range(config.decode.replicas):
            spec = worker_spec(config, Role.DECODE, i, collector_name, worker_log_level, secret)
            h = DecodeWorkerActor.options(**_rank0_options(handles, "decode", i)).remote(spec)
            handles.decode.append(WorkerSlot(spec.worker_id, h))
        _wait_ready(handles, ready_timeout_s, should_stop)
    except BaseException:
        handles.shutdown()
        raise
    return handles


# How often the wait for the workers asks whether to stop.
READY_POLL_S = 0.5


def _wait_ready(handles: ClusterHandles, timeout_s: float, should_stop: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout_s
    pending = {w.worker_id: (w, w.handle.ready.remote()) for w in handles.prefill + handles.decode}
    while pending:
        if should_stop():
            raise BuildStopped(f"while workers {sorted(pending)} started")
        left = deadline - time.monotonic()
        if left <= 0:
            raise ClusterBuildError(
                f"workers {sorted(pending)} were not ready within {timeout_s:.0f}s: not enough resources "
                f"(check `ray status` against prefill/decode resources) or a slow model load"
            )
        refs = [ref for _, ref in pending.values()]
        done, _ = ray.wait(refs, num_returns=1, timeout=min(left, READY_POLL_S))
        for ref in done:
            wid = next(k for k, (_, r) in pending.items() if r == ref)
            w, _ = pending.pop(wid)
            try:
                ray.get(ref, timeout=1)
            except (RayActorError, RayTaskError, GetTimeoutError) as e:
                raise ClusterBuildError(f"worker {wid} failed to start: {_root_cause(e)}") from e
            log.info("worker %s ready", wid)


def _root_cause(e: BaseException) -> str:
    """What made a worker fail to start, in a line: the exception its constructor raised, not
    Ray's wrapper of it (a colored call site and the whole traceback)."""
    cause = getattr(e, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    if isinstance(e, RayActorError) and e.actor_init_failed:
        # Ray keeps the constructor's exception only as text (ActorDiedError.cause is unset):
        # its traceback (indented lines) ends with the exception's lines, flush left. The full
        # text stays chained (``from``).
        lines = [line for line in _ANSI.sub("", str(e)).splitlines() if line.strip()]
        last = max((i for i, line in enumerate(lines) if line[0].isspace()), default=-1)
        error = " ".join(lines[last + 1 :]) or lines[-1].strip()
        return f"{error} (raised in its constructor; its log has the traceback)"
    return f"{type(e).__name__}: {e}"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # (Ray colors the call site in its messages)
