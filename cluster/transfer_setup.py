"""From the cluster config's ``transfer`` section to a worker's KV sender or receiver, and the
cluster's transfer secret (made by ``duet serve``, handed to every worker)."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable

from cluster.config import ClusterConfig
from cluster.config.transfer import SECRET_ENV
from engine.engine_core import LLMEngine
from transfer import FaultInjection, KVReceiver, KVSender, TransceiverConfig


def cluster_secret(config: ClusterConfig, make: bool = False) -> str:
    """The cluster's transfer secret: ``transfer.secret``, else the environment variable
    DUET_TRANSFER_SECRET, else (``make``: what `duet serve` does) a fresh random one. Raises
    ValueError when there is none and none may be made (a worker started without one)."""
    if config.transfer.secret is not None:
        return config.transfer.secret.get_secret_value()
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    if make:
        return secrets.token_urlsafe(32)
    raise ValueError(
        f"no transfer secret: set transfer.secret or {SECRET_ENV} for workers started "
        "without `duet serve`"
    )


def _interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux), for ``transfer.interface``."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
    except OSError as e:  # (0x8915: SIOCGIFADDR)
        raise ValueError(
            f"transfer.interface {name!r}: no IPv4 address here ({e.strerror})"
        ) from None
    return socket.inet_ntoa(packed[20:24])


def transceiver_config(config: ClusterConfig, secret: str | None = None) -> TransceiverConfig:
    """The transceiver settings of ``config``; ``secret`` as handed over by `duet serve`, else
    ``cluster_secret(config)``."""
    t = config.transfer
    faults = t.fault_injection
    return TransceiverConfig(
        secret=secret or cluster_secret(config),
        host=_interface_address(t.interface) if t.interface else t.host,
        port=t.port,
        staging_tokens=t.staging_tokens,
        staging_buffers=t.staging_buffers,
        direct_copy=t.direct_copy,
        lease_s=t.lease_s,
        connect_deadline_s=t.connect_deadline_s,
        pull_deadline_s=t.pull_deadline_s,
        chunk_deadline_s=t.chunk_deadline_s,
        done_deadline_s=t.done_deadline_s,
        ack_deadline_s=t.ack_deadline_s,
        ucx_env=t.ucx_environment,
        progress_mode=t.progress_mode,
        # Nothing in the cluster drains the transfer records (the counters and the last one are
        # what the workers' stats show): "all" would grow for the life of the worker.
        max_stats_len=config.stats.max_stats_len
        if config.stats.max_stats_len >= 0
        else TransceiverConfig.max_stats_len,
        fault_injection=FaultInjection(faults.fraction, tuple(faults.points), faults.seed),
    )


def _model_identity(engine: LLMEngine) -> str:
    # Part of the compatibility hash: peers must run the same model (name and shape).
    mc = engine.model_config
    return f"{engine.model_name}:{mc.num_layers}x{mc.num_kv_heads}x{mc.head_dim}:v{mc.vocab_size}"


def make_publisher(
    engine: LLMEngine,
    config: ClusterConfig,
    release: Callable[[str], None],
    secret: str | None = None,
) -> KVSender:
    kv, tc = engine.kv, transceiver_config(config, secret)
    try:
        return KVSender(kv.buffers, list(kv.specs.values()), _model_identity(engine), tc, release)
    except OSError as e:  # the listener: name the setting that chose the address
        field = "interface" if config.transfer.interface else "host / port"
        raise ValueError(f"transfer.{field} ({tc.host}:{tc.port}): cannot listen here: {e}") from e


def make_puller(engine: LLMEngine, config: ClusterConfig, secret: str | None = None) -> KVReceiver:
    kv = engine.kv
    return KVReceiver(
        kv.buffers,
        list(kv.specs.values()),
        _model_identity(engine),
        transceiver_config(config, secret),
    )
