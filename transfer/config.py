"""TransceiverConfig: staging, leases, deadlines and UCX settings of one worker's transceiver.

The field names match the ``transfer`` section of the cluster config (cluster/config/transfer.py),
which validates the YAML and builds this from it; tests build it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROGRESS_MODES = ("auto", "thread", "thread-polling")


def resolve_progress_mode(mode: str, cuda: bool, direct_copy: bool = False) -> str:
    """The ucxx progress mode for ``mode`` ("auto" picks by where the KV lives and how it moves)."""
    if mode == "auto":
        return "thread-polling" if cuda and not direct_copy else "thread"
    return mode


@dataclass(frozen=True)
class TransceiverConfig:
    host: str = "127.0.0.1"
    """Address the control listener binds to (prefill side)."""
    port: int = 0
    """Listener port; 0 = any free port."""
    staging_tokens: int = 4096
    """Tokens per chunk (one staging buffer holds this many tokens of every pool group). Requests
    larger than this travel in several pipelined chunks."""
    staging_buffers: int = 4
    """Staging buffers per side, shared by concurrent transfers; made on first use. Also the number
    of staged chunks one transfer can have in flight."""
    prestage: bool = True
    """While some decode worker pulls from this prefill worker over UCX, gather each published
    request's first staged chunk at publish time (transfer/prestage.py): the pull then starts
    sending at once instead of after a copy. Holds at most half of the staging buffers."""
    zero_copy: bool = True
    """Send a chunk whose pages are one run on this side straight from the pool, and receive one
    straight into the pool, without a gather / scatter on this side (the other side may still
    stage it). (Runs longer than a staging buffer always go straight.)"""
    host_iov: bool = True
    """With ``zero_copy``, and pools in host memory: a chunk whose pages are not one run on this
    side also skips the staging copy, sent or received as one UCX message that lists its pages
    (UCP's IOV datatype, transfer/ucp_iov.py). GPU pools always stage such chunks."""
    piece_chunk_tokens: int = 16384
    """Tokens per chunk on a link where both sides list host pages (``host_iov``): no staging
    buffer bounds those chunks, and on a few cores each UCX message costs wake-ups of several
    threads on both sides, so they are larger than ``staging_tokens`` (at least that many tokens,
    and at most 1 GiB: transfer.plan.DIRECT_MAX_BYTES)."""
    direct_copy: bool = True
    """P offers its pools (CUDA IPC on GPUs; on the CPU, the pools' shared-memory files) and its
    lease board in the handshake; a decode side that can open them (two GPUs of one host, two
    processes of one host on the CPU, or one process) reads each request's pages itself with one
    copy instead of receiving them through UCX (transfer/direct_read.py). Links where it cannot
    fall back to UCX on their own."""
    lease_s: float = 30.0
    """How long P keeps a published request's pages for D; renewed while the pull progresses."""
    connect_deadline_s: float = 10.0
    """Control connection, handshake and UCX endpoint to a peer."""
    pull_deadline_s: float = 30.0
    """From the pull request to the first chunk (or P's answer)."""
    chunk_deadline_s: float = 10.0
    """Between two chunks, on both sides (P waits this long for D's credits, too)."""
    done_deadline_s: float = 10.0
    """From the last chunk to TransferDone."""
    ack_deadline_s: float = 10.0
    """P waits this long after TransferDone for D's ack, then frees the pages."""
    ucx_env: dict[str, str] = field(default_factory=dict)
    """UCX_* settings of the process's UCX context (e.g. UCX_TLS, UCX_NET_DEVICES)."""
    progress_mode: str = "auto"
    """How UCX is progressed: "thread" (its thread sleeps until the network wakes it: no idle CPU,
    but each message pays wake-ups), "thread-polling" (its thread spins: one busy core per
    process, several times less latency per message), or "auto": polling when the KV is on a
    GPU and moves over UCX (latency decides NVLink throughput there), sleeping on CPU and when
    ``direct_copy`` is on (same-host peers then read directly, without UCX messages, and a
    spinning progress thread made each direct read about 25% slower on 2 H200s:
    docs/benchmarks/transfer.md). Multi-host GPU clusters with direct_copy on may still prefer
    "thread-polling" for their UCX pulls."""
    max_stats_len: int = 1000
    """Finished transfers kept for ``drain_transfer_stats``: -1 unbounded, 0 none, N the last N."""

    def __post_init__(self) -> None:
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
                f"staging_tokens and staging_buffers must be >= 1, got {self.staging_tokens}, {self.staging_buffers}"
            )
        if self.piece_chunk_tokens < 1:
            raise ValueError(f"piece_chunk_tokens must be >= 1, got {self.piece_chunk_tokens}")
        if self.progress_mode not in PROGRESS_MODES:
            raise ValueError(
                f"progress_mode must be one of {PROGRESS_MODES}, got {self.progress_mode!r}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
