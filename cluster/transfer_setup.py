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

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(
            s.fileno(), 0x8915, struct.pack("256s", name[:15].encode())
        )  # SIOCGIFADDR
    return socket.inet_ntoa(packed[20:24])


def transceiver_config(config: ClusterConfig) -> TransceiverConfig:
    t = config.transfer
    env = dict(t.ucx_env)
    if t.ucx_tls:
        env["UCX_TLS"] = ",".join(t.ucx_tls)
    if t.ucx_net_devices:
        env["UCX_NET_DEVICES"] = t.ucx_net_devices
    return TransceiverConfig(
        host=_interface_address(t.interface) if t.interface else t.host,
        port=t.port,
        staging_tokens=t.staging_tokens,
        direct_copy=t.direct_copy,
        lease_s=t.lease_s,
        connect_deadline_s=t.connect_deadline_s,
        pull_deadline_s=t.pull_deadline_s,
        chunk_deadline_s=t.chunk_deadline_s,
        done_deadline_s=t.done_deadline_s,
        ack_deadline_s=t.ack_deadline_s,
        ucx_env=env,
        max_stats_len=config.stats.max_stats_len,
    )


def _model_identity(engine: LLMEngine) -> str:
    # Part of the compatibility hash: peers must run the same model (name and shape).
    mc = engine.model_config
    return f"{engine.model_name}:{mc.num_layers}x{mc.num_kv_heads}x{mc.head_dim}:v{mc.vocab_size}"


def make_publisher(
    engine: LLMEngine, config: ClusterConfig, release: Callable[[str], None]
) -> KVSender:
    kv = engine.kv
    return KVSender(
        kv.buffers,
        list(kv.specs.values()),
        _model_identity(engine),
        transceiver_config(config),
        release,
    )


def make_puller(engine: LLMEngine, config: ClusterConfig) -> KVReceiver:
    kv = engine.kv
    return KVReceiver(
        kv.buffers, list(kv.specs.values()), _model_identity(engine), transceiver_config(config)
    )
