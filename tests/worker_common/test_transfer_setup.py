"""A worker's transceiver on its own node: what only that node can settle (the address of
``transfer.interface``, whether ``transfer.port`` is free) fails there, naming the field."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from cluster.config import config_from_dict
from cluster.worker_specs import worker_spec
from tests.tiny_engine import tiny_engine
from transfer import KVReceiver
from worker_common.messages import Role
from worker_common.tp_ranks import take_worker_down
from worker_common.transfer_setup import make_publisher, make_puller, node_transceiver_config


def spec_of(transfer: dict, role: Role = Role.PREFILL):  # noqa: ANN201
    return worker_spec(config_from_dict({"transfer": transfer}), role, 0, None, transfer_secret="x")


def test_an_interface_is_resolved_on_the_workers_node() -> None:
    spec = spec_of({"interface": "lo"})
    assert spec.transfer_interface == "lo"
    assert node_transceiver_config(spec).host == "127.0.0.1"
    with pytest.raises(ValueError, match="transfer.interface 'nosuch0': no IPv4 address"):
        node_transceiver_config(dataclasses.replace(spec, transfer_interface="nosuch0"))


def test_a_decode_worker_needs_no_interface_on_its_node() -> None:
    """Only prefill workers listen: a decode node without the interface's name still starts (it
    dials the addresses in its tickets)."""
    spec = spec_of({"interface": "nosuch0"}, Role.DECODE)
    puller = make_puller(tiny_engine(16), spec)
    try:
        assert puller.config.host == spec.transceiver.host  # (never looked up)
        # Pages UCX may still write after its link's abort: the worker goes down, not frees them.
        assert isinstance(puller, KVReceiver)
        assert puller.on_wedged is not None and puller.on_wedged.func is take_worker_down
    finally:
        puller.close()


def test_a_port_taken_on_this_node_names_its_field() -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"transfer.host / port \(127.0.0.1:{port}\)"):
            make_publisher(tiny_engine(16), spec_of({"port": port}), lambda rid: None)
    finally:
        taken.close()


def test_peers_of_other_weights_of_the_same_shape_are_incompatible() -> None:
    """The compatibility hash names the weights (engine/loaders/fingerprint.py), not only the
    model's name and shape: a decode worker would decode another model's KV, and cache it."""
    spec = spec_of({}, Role.DECODE)
    hashes = []
    for seed in (0, 0, 1):
        puller = make_puller(tiny_engine(16, seed=seed), spec)
        try:
            hashes.append(puller.page_table.compat_hash)
        finally:
            puller.close()
    assert hashes[0] == hashes[1] != hashes[2]
