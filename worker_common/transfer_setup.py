"""A worker's KV sender or receiver, made from its WorkerSpec on its own node.

The cluster config's ``transfer`` section becomes a TransceiverConfig in the server process
(cluster/transfer_setup.py); what only the worker's node can settle (the address of
``transfer.interface``, whether the port is free) is settled here, and an error names the field.
A worker actor passes its own event loop: the transceiver runs there (transfer/runtime.py), so a
pull, its control messages and its host copies run where the worker awaits them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import socket
from collections.abc import Callable
from typing import Any

from engine.engine_core import LLMEngine
from transfer import KVReceiver, KVSender, TransceiverConfig
from worker_common.messages import WorkerSpec
from worker_common.tp_pull import TPPuller
from worker_common.tp_ranks import take_worker_down
from worker_common.tp_transfer import TPPublisher, plan_reads


def interface_address(name: str) -> str:
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


def node_transceiver_config(spec: WorkerSpec, listens: bool = True) -> TransceiverConfig:
    """The spec's TransceiverConfig, with the listener address of this node where the worker
    ``listens`` (a prefill worker; a decode worker only dials the addresses in its tickets, so
    its node need not have ``transfer.interface``)."""
    if spec.transceiver is None:
        raise ValueError(f"worker {spec.worker_id} has no transfer settings (aggregated mode)")
    if spec.transfer_interface is None or not listens:
        return spec.transceiver
    return dataclasses.replace(spec.transceiver, host=interface_address(spec.transfer_interface))


def _model_identity(engine: LLMEngine) -> str:
    # Part of the compatibility hash: peers must run the same model (name, shape and weights:
    # KV of other weights of the same shape would decode to garbage, and be cached).
    mc = engine.model_config
    shape = f"{mc.num_layers}x{mc.num_kv_heads}x{mc.head_dim}:v{mc.vocab_size}"
    return f"{engine.model_name}:{shape}:{engine.model_fingerprint}"


def make_publisher(
    engine: LLMEngine,
    spec: WorkerSpec,
    release: Callable[[str], None],
    loop: asyncio.AbstractEventLoop | None = None,
) -> KVSender | TPPublisher:
    """Rank 0's KVSender (on ``loop``, the worker's running loop, or None for a loop thread of
    the transfer runtime's own), wrapped in a TPPublisher when either side is tensor-parallel."""
    kv, tc = engine.kv, node_transceiver_config(spec)

    def sender(on_release: Callable[[str], None]) -> KVSender:
        try:
            return KVSender(
                kv.buffers, list(kv.specs.values()), _model_identity(engine), tc, on_release, loop
            )
        except OSError as e:  # the listener: name the setting that chose the address
            field = "interface" if spec.transfer_interface else "host / port"
            raise ValueError(
                f"transfer.{field} ({tc.host}:{tc.port}): cannot listen here: {e}"
            ) from e

    tp, peer = engine_tp(engine), spec.peer_tensor_parallel_size
    if tp == 1 and peer == 1:
        return sender(release)
    reads = plan_reads(engine.model_config.num_kv_heads, tp, peer)
    return TPPublisher(sender, rank_actors(engine), reads, release, tc, _model_identity(engine))


def make_puller(
    engine: LLMEngine, spec: WorkerSpec, loop: asyncio.AbstractEventLoop | None = None
) -> KVReceiver | TPPuller:
    """Rank 0's KVReceiver (on ``loop`` as in make_publisher), wrapped in a TPPuller when either
    side is tensor-parallel. Pages a transport may still write (a rank's pull past its bound,
    UCX receives outliving their link's abort) can never be freed: the worker goes down."""
    kv, tc = engine.kv, node_transceiver_config(spec, listens=False)
    lost = functools.partial(take_worker_down, spec.worker_id)
    own = KVReceiver(kv.buffers, list(kv.specs.values()), _model_identity(engine), tc, loop, lost)
    if engine_tp(engine) == 1 and spec.peer_tensor_parallel_size == 1:
        return own
    return TPPuller(own, rank_actors(engine), tc, _model_identity(engine), lost)


def engine_tp(engine: LLMEngine) -> int:
    return engine.tp.size if engine.tp is not None else 1


def rank_actors(engine: LLMEngine) -> list[Any]:
    """The Ray actors of ranks 1.. of a tensor-parallel worker's engine ([] at tp 1)."""
    return list(getattr(engine.local_ranks, "actors", []))
