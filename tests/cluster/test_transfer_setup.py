"""From the ``transfer`` section to a worker's transceiver: every setting reaches TransceiverConfig,
and the settings that can only fail on a worker's own node (its interface, its port) fail there
naming the field."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from cluster.config import config_from_dict
from cluster.transfer_setup import make_publisher, transceiver_config
from tests.tiny_engine import tiny_engine
from transfer import TransceiverConfig


def test_every_transfer_setting_reaches_the_transceiver() -> None:
    section = {
        "staging_tokens": 64,
        "staging_buffers": 2,
        "piece_chunk_tokens": 256,
        "direct_copy": False,
        "lease_s": 40.0,
        "connect_deadline_s": 3.0,
        "pull_deadline_s": 4.0,
        "chunk_deadline_s": 5.0,
        "done_deadline_s": 6.0,
        "ack_deadline_s": 7.0,
        "host": "127.0.0.2",
        "port": 5555,
        "progress_mode": "thread-polling",
        "ucx_tls": ["tcp", "self"],
        "ucx_net_devices": "lo",
        "ucx_env": {"UCX_RNDV_THRESH": 8192},
    }
    got = transceiver_config(config_from_dict({"transfer": section, "stats": {"max_stats_len": 9}}))
    expected = {**section, "ucx_tls": None, "ucx_net_devices": None, "ucx_env": None}
    for name, value in expected.items():
        if value is not None:
            assert getattr(got, name) == value, name
    assert got.ucx_env == {
        "UCX_RNDV_THRESH": "8192",
        "UCX_TLS": "tcp,self",
        "UCX_NET_DEVICES": "lo",
    }
    assert got.max_stats_len == 9
    unset = {f.name for f in dataclasses.fields(TransceiverConfig)} - set(section)
    assert unset == {
        "prestage",
        "zero_copy",
        "host_iov",
        "max_stats_len",
    }  # the transceiver's own defaults
    lo = transceiver_config(config_from_dict({"transfer": {"interface": "lo"}}))
    assert lo.host == "127.0.0.1"
    every = transceiver_config(config_from_dict({"stats": {"max_stats_len": -1}}))
    assert every.max_stats_len == 1000  # transfer records are never drained in the cluster


def test_an_interface_or_port_that_fails_on_this_node_names_its_field() -> None:
    with pytest.raises(ValueError, match="transfer.interface 'nosuch0': no IPv4 address"):
        transceiver_config(config_from_dict({"transfer": {"interface": "nosuch0"}}))
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        config = config_from_dict({"transfer": {"port": port}})
        with pytest.raises(ValueError, match=rf"transfer.host / port \(127.0.0.1:{port}\)"):
            make_publisher(tiny_engine(16), config, lambda rid: None)
    finally:
        taken.close()
