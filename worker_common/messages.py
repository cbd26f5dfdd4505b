"""What crosses the router/worker boundary: small typed messages, plain data only.

Every call between the server process (router, stats poller, builder) and a worker actor takes and
returns these (or the engine's and the transfer's own dataclasses they embed). Each is validated
once where it is made: a request at the HTTP edge (its SamplingParams validate on construction and
are never re-validated: unpickling does not run ``__init__``), a WorkerSpec by the cluster config.

Clocks: every timestamp is wall-clock seconds (``time.time()``) taken on the reporting worker, so P's
and D's timings of one request can be joined; a span across two roles includes their clock skew.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from engine.logprobs import TokenLogprobs
from engine.sampling_params import SamplingParams
from worker_common.prompt_tokens import PromptTokens

if TYPE_CHECKING:
    from engine.engine_config import EngineConfig
    from engine.stats import IterationStats
    from kvcache.kv_events import KVEvent
    from kvcache.stats import KVCacheStats
    from transfer.config import TransceiverConfig
    from transfer.messages import TransferTicket
    from transfer.stats import TransferStats


class Role(str, enum.Enum):
    """Which side of the disaggregated pipeline a worker (or a timing record) is."""

    PREFILL = "prefill"
    DECODE = "decode"


# ---- building a worker --------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerDeadlines:
    """Every wait a worker bounds on its own (the transfer's waits are in TransceiverConfig)."""

    prefill_s: float = 300.0  # P: from admission to the first token
    page_wait_s: float = 60.0  # D: waiting for free KV pages for an incoming request
    token_s: float = 300.0  # D: between two tokens of one request


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker actor is built from (the builder makes it from the cluster config).

    ``engine.device`` is "cuda" for a GPU worker: the worker picks its own GPU on its node
    (worker_common/engine_setup.py), as it resolves ``transfer_interface`` to an address there.
    """

    worker_id: str
    role: Role
    engine: EngineConfig
    transceiver: TransceiverConfig | None  # None: no transfer (a decode worker in aggregated mode)
    transfer_interface: str | None  # network interface whose address the P listener binds to
    deadlines: WorkerDeadlines
    stats_interval_s: float  # the KV peak interval: peaks reset at each end
    collector_name: str | None  # the perf-metrics collector actor; None: per-request stats off
    log_level: str = "INFO"
    publish_kv_events: bool = False  # the router indexes what this worker caches (kv_aware, ...)
    # D: after a failed, expired or refused pull, "fail" the request or "recompute" (prefill it
    # here); transfer.on_failure.
    on_transfer_failure: Literal["fail", "recompute"] = "fail"
    # CPUs Ray reserves for this worker (resources.num_cpus): on a CPU device, its torch threads
    # (engine/cpu_share.py); None: every core the process may use.
    num_cpus: float | None = None
    # GPUs Ray reserves per rank (resources.num_gpus): what ranks 1.. of a tensor-parallel worker
    # ask for in its placement group (worker_common/tp_ranks.py).
    num_gpus: float = 0.0
    # The other side's tensor_parallel_size (decode's for a prefill worker, prefill's for a
    # decode worker): with either above 1, the transfer runs rank to rank (tp_transfer.py).
    peer_tensor_parallel_size: int = 1


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP edge needs to know of the model the workers run."""

    max_model_len: int
    vocab_size: int


# ---- requests -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateRequest:
    """One request as the router hands it to a worker, already validated at the HTTP edge."""

    request_id: str
    prompt_token_ids: PromptTokens
    sampling: SamplingParams
    arrival_time: float  # time.time() at the router
    # How many of the router's prefill attempts for this request failed before this call: on a
    # prefill worker, the attempt it runs (0: the first); on a decode worker, the attempt whose KV
    # it gets, or when it prefills the request itself, how many failed first. Its reports carry
    # it, so that the collector joins D's report with the prefill report of the same attempt.
    prefill_attempt: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_token_ids, PromptTokens):
            object.__setattr__(self, "prompt_token_ids", PromptTokens(self.prompt_token_ids))
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(
                f"GenerateRequest.sampling must be a SamplingParams, got {type(self.sampling).__name__}"
            )


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill worker replies once context finalization is done and the pages are leased.

    ``ticket`` is None when the request already finished at its first token (max_tokens == 1 or a
    stop condition); the prefill worker then released the pages itself.
    """

    request_id: str
    first_token_id: int
    # The first token's text as far as the client may see it now: while the request goes on, the
    # end that a stop string could still claim is held back (the decode side streams it or not).
    first_token_text: str
    finish_reason: str | None
    ticket: TransferTicket | None
    stop_reason: int | str | None = None  # when it finished: the stop token id or string
    # When the request asks for logprobs (SamplingParams.logprobs): the first token's.
    first_token_logprobs: TokenLogprobs | None = None
    # When it asks for prompt_logprobs: one per prompt token, the first None.
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    # Prompt tokens this worker found in its prefix cache (device and host tier together).
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class TokenDelta:
    """A piece of a streamed answer: new tokens, their text, and the finish reason on the last one."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # set when the request failed on our side
    # On the last delta: the stop token id or stop string that ended it (vLLM's stop_reason).
    stop_reason: int | str | None = None
    # On the decode worker's first delta of a request whose KV transfer failed and which it
    # prefilled itself (transfer.on_failure: recompute): the prefill worker's lease is no use now.
    kv_recomputed: bool = False
    # When the request asks for logprobs: one per token of ``token_ids`` (engine/logprobs.py).
    logprobs: tuple[TokenLogprobs, ...] = ()
    # On the first delta, when the request asks for prompt_logprobs: one per prompt token, the
    # first None (engine/prompt_logprobs.py).
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    # On the first delta from the worker that computed the prompt (the router's, made of P's
    # PrefillResult; D's own when it prefilled the request, a recompute's too): the prompt tokens
    # it found in its prefix cache (device and host tier together), OpenAI's usage
    # prompt_tokens_details.cached_tokens. None: this delta does not say (the latest that did
    # counts: a recompute's, after P's).
    num_cached_tokens: int | None = None
    # On an error delta: the request ran past server.request_timeout_s (the server answers 504,
    # not 500: nothing failed, the time ran out).
    timed_out: bool = False


# ---- per-request stats (to the perf-metrics collector) -----------------------------------------


@dataclass(frozen=True)
class RequestTimings:
    """What one worker saw of one request. A field the role never reaches stays None (or 0).

    ``last_report`` tells the collector that no other role will report this request: the decode
    worker sets it when it prefilled the request itself (aggregated mode, or fallback when no prefill
    worker was healthy); the prefill worker sets it when the request finished on it at its first
    token (a stop, or max_tokens 1). A prefill that failed or was aborted is not the last report:
    the router may try again elsewhere, or have the decode worker prefill it; when the router ends
    the request without a decode worker it says so itself (``cluster.messages.RequestClosed``).
    Without it, the collector waits for every expected role.

    ``prefill_attempt``: the router's attempt this report belongs to (``GenerateRequest``'s).
    """

    request_id: str
    role: Role
    worker_id: str
    arrival_time: float | None = None  # the request reached this worker
    router_arrival_time: float | None = None  # it reached the router (GenerateRequest's)
    queue_start: float | None = None  # entered the worker's scheduler queue
    queue_end: float | None = None  # first scheduled
    prefill_start: float | None = None  # first prefill chunk started
    prefill_end: float | None = None  # last prefill chunk finished
    first_token_time: float | None = None  # the first output token was sampled
    transfer_start: float | None = None  # KV transfer began (D: pull sent)
    transfer_end: float | None = None  # KV transfer finished (D: done checked)
    transfer_bytes: int = 0
    transfer_path: str | None = None  # D: "ucx", "cuda_ipc" or "host_shm" (transfer/paths/)
    decode_start: float | None = None  # first decode step that included this request
    last_token_time: float | None = None
    finish_time: float | None = None  # the worker released the request
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens this worker did not compute: its prefix-cache hit
    # The same hit by where the pages were found: "device" is the worker's KV pool (GPU memory, or
    # host memory on a CPU worker), "host" its KV host tier (loaded back for this request).
    cached_tokens_by_medium: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0  # output tokens produced by this worker
    num_preemptions: int = 0  # times the worker's scheduler preempted it (recomputed)
    token_gaps_s: tuple[float, ...] = ()  # gaps between consecutive tokens this worker sampled
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None if handed off
    last_report: bool = False
    prefill_attempt: int = 0

    def __post_init__(self) -> None:
        # Accept the plain string too ("prefill"), as JSON and YAML hand it over.
        object.__setattr__(self, "role", Role(self.role))
        object.__setattr__(self, "token_gaps_s", tuple(self.token_gaps_s))


# ---- worker stats (to the server's stats poller) ------------------------------------------------


@dataclass(frozen=True)
class TransferTotals:
    """A worker's running totals of its KV transfers (sender on P, receiver on D)."""

    transfers_ok: int = 0
    failures: int = 0  # D: every pull that failed or could not run; P: failed sends
    bytes: int = 0
    expired_leases: int = 0  # P: leases that ran out before D acknowledged
    refused_peers: int = 0  # peers refused in the handshake (no secret, another model, ...)
    injected_faults: int = 0  # pulls failed on purpose (transfer.fault_injection)
    wedged_messages: int = 0  # UCX messages that outlived their link's abort (paths/ucx.py)
    refused_pulls: int = 0  # P: pulls refused (a forged, stale or replayed ticket; a bad plan)
    rejected_messages: int = 0  # control messages that did not decode (a peer's bug or probe)
    recomputed: int = 0  # D: failed pulls whose request D prefilled itself (on_failure: recompute)
    failed_requests: int = 0  # D: failed pulls whose request ended with an error


@dataclass(frozen=True)
class WorkerStats:
    """One worker's state now. ``kv_interval`` is the KV snapshot taken at the end of the last
    complete stats interval (its ``peak_used`` is that interval's peak); None before one ended."""

    worker_id: str
    role: Role
    pid: int
    healthy: bool
    num_waiting: int
    num_running: int
    num_in_flight: int  # P: prefills admitted and not answered; D: KV receives in flight
    kv: KVCacheStats
    kv_interval: KVCacheStats | None
    transfer: TransferTotals
    num_iterations: int  # engine steps so far: the last IterationStats.iteration


@dataclass(frozen=True)
class StatsBatch:
    """What one stats poll takes from a worker: its state, and the iteration stats and transfer
    records recorded since the previous poll (drained: each record is handed out once)."""

    stats: WorkerStats
    iterations: list[IterationStats]
    transfers: list[TransferStats]


# ---- KV events (to the router's prefix index) ---------------------------------------------------


@dataclass(frozen=True)
class KVEventBatch:
    """The KV events of one worker's engine step (kvcache/kv_events.py), numbered: ``seq`` is 1, 2,
    ... per ``epoch`` (one per worker process), so a receiver sees any batch it missed."""

    worker_id: str
    epoch: str
    seq: int
    events: list[KVEvent]


@dataclass(frozen=True)
class KVEventPoll:
    """A worker's answer to the router's poll: its epoch, the batches after the one asked for (none
    when the epoch asked for is not the worker's: the router must rebuild), and the number of its
    latest batch (so a lost batch shows even when no later one came)."""

    epoch: str
    batches: list[KVEventBatch]
    last_seq: int = 0


@dataclass(frozen=True)
class KVSnapshot:
    """Every block a worker's KV cache can find now (group -> medium -> block hashes), which
    includes every batch up to ``seq``: the router rebuilds its index of the worker from it."""

    worker_id: str
    epoch: str
    seq: int
    blocks: dict[str, dict[str, list[int]]] = field(default_factory=dict)
