"""TransceiverConfig: the cluster secret, staging, leases, deadlines, UCX settings and fault injection
of one worker's transceiver.

The field names match the ``transfer`` section of the cluster config (cluster/config/transfer.py),
which validates the YAML and builds this from it; tests build it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROGRESS_MODES = ("auto", "loop", "thread", "thread-polling")
# Where an injected fault fails a pull (faults.py says which side acts on which).
FAULT_POINTS = ("connect", "before_data", "mid_data", "before_ack")


@dataclass(frozen=True)
class FaultInjection:
    """Fail a seeded ``fraction`` of pulls at one of ``points`` each (for tests and rehearsals)."""

    fraction: float = 0.0
    points: tuple[str, ...] = FAULT_POINTS
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fault fraction must be in [0, 1], got {self.fraction}")
        unknown = sorted(set(self.points) - set(FAULT_POINTS))
        if not self.points or unknown:
            raise ValueError(f"fault points must be some of {FAULT_POINTS}, got {self.points}")


@dataclass(frozen=True)
class TransceiverConfig:
    secret: str = field(default="", repr=False)
    """The cluster's shared secret: peers prove they know it (HMAC challenge-response) before any
    page table, address or pool export is sent. Required."""
    host: str = "127.0.0.1"
    """Address the control listener binds to (prefill side)."""
    port: int = 0
    """Listener port; 0 = any free port."""
    staging_tokens: int = 4096
    """Tokens per UCX chunk: one staging buffer holds this many tokens of every pool group. Larger
    requests travel in several pipelined chunks."""
    staging_buffers: int = 4
    """Staging buffers per side, shared by its concurrent UCX pulls; made on first use."""
    direct_copy: bool = True
    """P offers its pools in the handshake (CUDA IPC on GPUs, memfd files on the CPU); a decode
    side of the same host that can open them reads pages itself instead of over UCX."""
    lease_s: float = 30.0
    """How long P keeps a published request's pages for D before the lease expires (a pull in
    progress holds the lease: it never expires under it)."""
    connect_deadline_s: float = 10.0
    """Control connection, authentication, handshake and UCX endpoint to a peer."""
    pull_deadline_s: float = 30.0
    """From the pull request to P's first chunk or its answer."""
    chunk_deadline_s: float = 10.0
    """Between two chunks on both sides; also the longest a direct read's copy may take."""
    done_deadline_s: float = 10.0
    """From the last chunk to TransferDone."""
    ack_deadline_s: float = 10.0
    """P waits this long for D's final notice after the data, then releases the pages."""
    ucx_env: dict[str, str] = field(default_factory=dict)
    """UCX_* settings of the process's UCX context (e.g. UCX_TLS, UCX_NET_DEVICES)."""
    progress_mode: str = "auto"
    """How UCX is progressed: "loop" (by the transceiver's event loop: polled while data messages
    are in flight, asleep on UCX's event descriptor otherwise; progress.py), "thread" (ucxx's
    progress thread, asleep until woken, and a notifier thread that hands completions to the
    loop), "thread-polling" (that thread spins: lower latency per message, one busy core), or
    "auto": for KV that moves over UCX, loop from host memory and thread-polling from a GPU;
    thread where KV is read directly."""
    max_stats_len: int = 1000
    """Finished transfers kept for ``drain_transfer_stats``: -1 unbounded, 0 none, N the last N."""
    fault_injection: FaultInjection = field(default_factory=FaultInjection)
    """Pulls to fail on purpose (off by default)."""

    def __post_init__(self) -> None:
        if not self.secret:
            raise ValueError(
                "the transceiver needs the cluster's secret (transfer.secret, or "
                "DUET_TRANSFER_SECRET; `duet serve` makes one)"
            )
        deadlines = {
            "lease_s": self.lease_s,
            "connect_deadline_s": self.connect_deadline_s,
            "pull_deadline_s": self.pull_deadline_s,
            "chunk_deadline_s": self.chunk_deadline_s,
            "done_deadline_s": self.done_deadline_s,
            "ack_deadline_s": self.ack_deadline_s,
        }
        bad = {k: v for k, v in deadlines.items() if not v > 0}
        if bad:
            raise ValueError(f"deadlines must be > 0 seconds, got {bad}")
        if self.staging_tokens < 1 or self.staging_buffers < 1:
            raise ValueError(
                f"staging_tokens and staging_buffers must be >= 1, got {self.staging_tokens}, "
                f"{self.staging_buffers}"
            )
        if self.progress_mode not in PROGRESS_MODES:
            raise ValueError(
                f"progress_mode must be one of {PROGRESS_MODES}, got {self.progress_mode!r}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")

    def ucx_progress_mode(self, cuda: bool) -> str:
        """The ucxx progress mode for KV on a GPU (``cuda``) or in host memory."""
        if self.progress_mode == "auto":
            # KV over UCX: polled while it moves (progress.py says what each mode costs). Direct
            # reads move no data over UCX: its thread only sleeps.
            if self.direct_copy:
                return "thread"
            return "thread-polling" if cuda else "loop"
        return self.progress_mode
