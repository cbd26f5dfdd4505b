"""From the cluster config's ``transfer`` section to a worker's KV sender or receiver."""

from __future__ import annotations

import socket
from collections.abc import Callable

from cluster.config import ClusterConfig
from engine.engine_core import LLMEngine
from transfer import KVReceiver, KVSender, TransceiverConfig


def _interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux), for ``transfer.interface``."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(
                s.fileno(), 0x8915, struct.pack("256s", name[:15].encode())
            )  # SIOCGIFADDR
    except OSError as e:
        raise ValueError(
            f"transfer.interface {name!r}: no IPv4 address here ({e.strerror})"
        ) from None
    return socket.inet_ntoa(packed[20:24])


def transceiver_config(config: ClusterConfig) -> TransceiverConfig:
    t = config.transfer
    return TransceiverConfig(
        host=_interface_address(t.interface) if t.interface else t.host,
        port=t.port,
        staging_tokens=t.staging_tokens,
        staging_buffers=t.staging_buffers,
        piece_chunk_tokens=t.piece_chunk_tokens,
        progress_mode=t.progress_mode,
        direct_copy=t.direct_copy,
        lease_s=t.lease_s,
        connect_deadline_s=t.connect_deadline_s,
        pull_deadline_s=t.pull_deadline_s,
        chunk_deadline_s=t.chunk_deadline_s,
        done_deadline_s=t.done_deadline_s,
        ack_deadline_s=t.ack_deadline_s,
        ucx_env=t.ucx_environment,
        # Nothing in the cluster drains the transfer records (the counters and the last one are
        # what the workers' stats show): "all" would grow for the life of the worker.
        max_stats_len=config.stats.max_stats_len
        if config.stats.max_stats_len >= 0
        else TransceiverConfig.max_stats_len,
    )


def _model_identity(engine: LLMEngine) -> str:
    # Part of the compatibility hash: peers must run the same model (name and shape).
    mc = engine.model_config
    return f"{engine.model_name}:{mc.num_layers}x{mc.num_kv_heads}x{mc.head_dim}:v{mc.vocab_size}"


def make_publisher(
    engine: LLMEngine, config: ClusterConfig, release: Callable[[str], None]
) -> KVSender:
    kv, tc = engine.kv, transceiver_config(config)
    try:
        return KVSender(kv.buffers, list(kv.specs.values()), _model_identity(engine), tc, release)
    except OSError as e:  # the listener: name the setting that chose the address
        field = "interface" if config.transfer.interface else "host / port"
        raise ValueError(f"transfer.{field} ({tc.host}:{tc.port}): cannot listen here: {e}") from e


def make_puller(engine: LLMEngine, config: ClusterConfig) -> KVReceiver:
    kv = engine.kv
    return KVReceiver(
        kv.buffers, list(kv.specs.values()), _model_identity(engine), transceiver_config(config)
    )
