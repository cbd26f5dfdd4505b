"""The ``router``, ``server``, ``stats`` and ``ray`` sections: everything around the workers."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator

from cluster.config.base import Section

UNBOUNDED = -1


class RouterConfig(Section):
    """How the router picks a prefill and a decode worker for each request."""

    policy: Literal["round_robin", "load_balance", "prefix_aware", "kv_aware"] = Field(
        "load_balance",
        description=(
            "How the router picks the worker that prefills a request: a prefill worker, or in "
            "aggregated mode a decode worker (a disaggregated request's decode worker is the one "
            "with the fewest requests, then the most of its prompt cached, known from the "
            "workers' KV events under kv_aware or local_prefill_max_tokens > 0, then the most "
            "free pages). round_robin: in turn; load_balance: fewest queued + running requests; "
            "prefix_aware: requests sharing their first page go to one worker (by a rendezvous "
            "hash: a worker leaving moves only its own prefixes), unless it has more than 2 "
            "requests above the least loaded one (then that one); kv_aware: the least cost from "
            "what each worker has cached, known from its KV events (or being computed there for "
            "a prompt sent before): prompt tokens it does not hold, host-tier hits at half "
            "weight, plus the load this router put there: prefill tokens queued (less what this "
            "prompt shares with them) and the context tokens of the requests streaming from it "
            "(Dynamo's KV router)."
        ),
    )
    prefill_retries: int = Field(
        1,
        ge=0,
        description=(
            "Times a failed prefill is retried on another prefill worker (disaggregated mode)."
        ),
    )
    local_prefill_fallback: bool = Field(
        True,
        description=(
            "When no prefill worker can serve a request (none healthy, or every try of "
            "prefill_retries failed or passed prefill.prefill_deadline_s), let the decode worker "
            "prefill it locally; false: the request fails. Disaggregated mode; in aggregated "
            "mode decode workers always prefill."
        ),
    )
    local_prefill_max_tokens: int = Field(
        0,
        ge=0,
        description=(
            "Conditional disaggregation: when the decode worker chosen for a request already "
            "holds all but at most this many of its prompt tokens (its KV events say so; device "
            "or host tier), it prefills the rest itself and no KV transfer happens. 0 = always "
            "prefill on a prefill worker."
        ),
    )

    @property
    def uses_kv_events(self) -> bool:
        """Whether the router needs the workers' KV events (their prefix caches)."""
        return self.policy == "kv_aware" or self.local_prefill_max_tokens > 0


class ServerConfig(Section):
    """The OpenAI-compatible HTTP server."""

    host: str = Field(
        "127.0.0.1", min_length=1, description="Address to bind; 0.0.0.0 exposes it to the network."
    )
    port: int = Field(8000, ge=0, le=65535, description="Port to bind; 0 = any free port.")
    api_key: SecretStr | None = Field(
        None,
        description=(
            "Bearer token clients must send on every endpoint but /health, /metrics and /version "
            "(the stats endpoints drain what they return); None = no authentication."
        ),
    )

    @field_validator("api_key")
    @classmethod
    def _not_empty(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value():
            raise ValueError("must not be empty (an empty key would turn authentication off)")
        return value

    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description=(
            "Longest a request may take from its arrival at the router; then it is aborted on "
            "every worker and the client gets an error (a streamed answer whose client has "
            "stopped reading is cut off then, a blocked send given at least 5 s)."
        ),
    )
    max_request_body_mb: float = Field(
        32.0,
        gt=0,
        description=(
            "Largest request body the server reads, in MiB; a larger one gets a 413 before it is "
            "parsed (a body is held and parsed whole: without a bound one client's gigabyte of "
            "JSON takes the server's memory). 32 MiB holds a batch of 32 prompts of 128k "
            "tokens as text, or about 5M prompt token ids."
        ),
    )
    shutdown_grace_s: float = Field(
        30.0,
        gt=0,
        description=(
            "On SIGTERM or Ctrl-C, how long `duet serve` lets open requests finish: new "
            "connections are refused at once, and streams still open after this are cut before "
            "the workers stop (a second Ctrl-C cuts them at once). Below your supervisor's kill "
            "timeout (Kubernetes: terminationGracePeriodSeconds, 30 s by default) so that the "
            "workers are stopped, not killed."
        ),
    )


class StatsConfig(Section):
    """Worker stats, iteration stats, transfer records and per-request stats.

    Every buffer follows one rule: -1 keeps everything (unbounded), 0 disables it at the source
    (nothing is recorded or sent; its endpoint answers an empty list), N keeps exactly the newest N.
    """

    max_stats_len: int = Field(
        1000,
        ge=UNBOUNDED,
        description=(
            "Iteration stats and transfer records: how many each worker keeps between two "
            "collections by the server, and how many per worker the server keeps for "
            "/iteration_stats and /transfer_stats between reads: -1 all, 0 none (not recorded), "
            "N the newest N."
        ),
    )
    interval_s: float = Field(
        10.0,
        gt=0,
        description=(
            "How often the server collects each worker's stats (load, KV usage, iteration stats, "
            "transfer records) and the per-request records, in the background; and each worker's "
            "KV stats interval: peak KV usage (in iteration stats, and on /metrics for the last "
            "complete interval) resets at the end of each."
        ),
    )
    perf_buffer_len: int = Field(
        10000,
        ge=UNBOUNDED,
        description=(
            "Per-request stats (/perf_metrics): each worker's engine buffer, the collector's "
            "buffer per worker and the server's buffer between reads: -1 all, 0 none (nothing "
            "recorded or sent; /metrics then has no per-request series either: latencies, "
            "tokens, finished requests), N the newest N."
        ),
    )
    max_pending_joins: int = Field(
        10000,
        gt=0,
        description="Requests waiting for their other role's timings; the oldest is dropped beyond.",
    )


class RayConfig(Section):
    """Where the cluster runs."""

    address: str | None = Field(
        None,
        min_length=1,
        description=(
            "None: the Ray cluster RAY_ADDRESS names (as `ray job submit` sets it), else a local "
            'Ray started bound to 127.0.0.1; "auto": join the Ray cluster this node belongs to; '
            '"host:port" or "ray://host:port": that one.'
        ),
    )
    namespace: str = Field("duet", min_length=1, description="Ray namespace of the named actors.")
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray runtime_env for every actor (env_vars, working_dir, pip, ...).",
    )

    @property
    def starts_local(self) -> bool:
        """Whether `duet serve` will start a local, one-host Ray (no address here, no RAY_ADDRESS
        in the environment): what connect_ray does with this section."""
        return self.address is None and not os.environ.get("RAY_ADDRESS")
