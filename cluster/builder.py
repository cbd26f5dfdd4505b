"""build_cluster: create the collector, prefill and decode actors, and wait until they are healthy.

Fails early: a worker that cannot start (bad model path, no resources on any node, a crash while
loading) ends the build with a message naming the worker and the cause, and every actor already
created is killed, so nothing is left behind.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cluster.collector import expected_roles_for
from cluster.collector_actor import start_collector_actor
from cluster.config import ClusterConfig
from cluster.router import Router, WorkerSlot
from cluster.transfer_setup import cluster_secret
from cluster.worker_setup import NOSET_VISIBLE_DEVICES
from decode_worker.actor import DecodeWorkerActor
from prefill_worker.actor import PrefillWorkerActor

log = logging.getLogger(__name__)


class ClusterBuildError(RuntimeError):
    """The cluster could not be built; the message says which worker failed and why."""


@dataclass
class ClusterHandles:
    config: ClusterConfig
    collector: Any
    prefill: list[WorkerSlot] = field(default_factory=list)
    decode: list[WorkerSlot] = field(default_factory=list)

    def router(self) -> Router:
        return Router(
            self.prefill,
            self.decode,
            policy=self.config.router.policy,
            prefill_retries=self.config.router.prefill_retries,
            local_prefill_fallback=self.config.router.local_prefill_fallback,
            page_size=self.config.kvcache.page_size,
            stats_interval_s=min(self.config.stats.interval_s, 1.0),
            call_timeout_s=self.config.server.request_timeout_s,
        )

    def shutdown(self) -> None:
        for w in self.prefill + self.decode:
            try:
                ray.get(w.handle.close.remote(), timeout=10)
            except Exception:
                pass
            ray.kill(w.handle, no_restart=True)
        ray.kill(self.collector, no_restart=True)


def _actor_options(config: ClusterConfig, role: str, index: int) -> dict[str, Any]:
    pool = config.prefill if role == "prefill" else config.decode
    r = pool.resources
    options: dict[str, Any] = {
        "num_cpus": r.num_cpus,
        "num_gpus": r.num_gpus,
        "max_restarts": 3,  # a crashed worker comes back (a new UCX address, so new tickets)
        "max_task_retries": 0,  # the router decides about retries, never Ray
        "max_concurrency": 1000,
    }
    if r.num_gpus > 0 and config.transfer.direct_copy and not config.aggregated:
        # Every GPU of the node visible to the worker (it picks its own by Ray's GPU id), so the
        # decode worker can open the prefill worker's pools through CUDA IPC (transfer/paths/).
        options["runtime_env"] = {"env_vars": {NOSET_VISIBLE_DEVICES: "1"}}
    if r.resources:
        options["resources"] = dict(r.resources)
    if r.label_selector:
        options["label_selector"] = dict(r.label_selector)
    return options


def build_cluster(
    config: ClusterConfig, ready_timeout_s: float = 600.0, transfer_secret: str | None = None
) -> ClusterHandles:
    """Create every actor of ``config`` in the connected Ray cluster; return when all are healthy.
    ``transfer_secret``: the secret the workers' transceivers prove to each other (a fresh one
    when None and neither ``transfer.secret`` nor DUET_TRANSFER_SECRET gives one)."""
    secret = transfer_secret or cluster_secret(config, make=True)
    collector = start_collector_actor(
        expected_roles_for(config.aggregated),
        max_records_per_worker=max(config.stats.perf_buffer_len, 1)
        if config.stats.perf_buffer_len != -1
        else 1_000_000,
        max_pending=config.stats.max_pending_joins,
    )
    handles = ClusterHandles(config, collector)
    config_json = config.model_dump(mode="json")
    if config.server.api_key is not None:  # model_dump hides secrets; the workers do not need it
        config_json["server"]["api_key"] = None
    config_json["transfer"]["secret"] = None  # (hidden too: it goes to the workers on its own)
    try:
        for i in range(config.prefill.replicas):
            wid = f"prefill-{i}"
            h = PrefillWorkerActor.options(**_actor_options(config, "prefill", i)).remote(
                config_json, wid, collector, secret
            )
            handles.prefill.append(WorkerSlot(wid, h))
        for i in range(config.decode.replicas):
            wid = f"decode-{i}"
            h = DecodeWorkerActor.options(**_actor_options(config, "decode", i)).remote(
                config_json, wid, collector, secret
            )
            handles.decode.append(WorkerSlot(wid, h))
        _wait_ready(handles, ready_timeout_s)
    except BaseException:
        handles.shutdown()
        raise
    return handles


def _wait_ready(handles: ClusterHandles, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = {w.worker_id: (w, w.handle.ready.remote()) for w in handles.prefill + handles.decode}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ClusterBuildError(
                f"workers {sorted(pending)} were not ready within {timeout_s:.0f}s: not enough resources "
                f"(check `ray status` against prefill/decode resources) or a slow model load"
            )
        refs = [ref for _, ref in pending.values()]
        done, _ = ray.wait(refs, num_returns=1, timeout=min(left, 5.0))
        for ref in done:
            wid = next(k for k, (_, r) in pending.items() if r == ref)
            w, _ = pending.pop(wid)
            try:
                ray.get(ref, timeout=1)
            except (RayActorError, RayTaskError, GetTimeoutError) as e:
                raise ClusterBuildError(f"worker {wid} failed to start: {_root_cause(e)}") from e
            log.info("worker %s ready", wid)


def _root_cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    return f"{type(e).__name__}: {e}"
