"""From the ``transfer`` section to a worker's transceiver: every setting reaches TransceiverConfig,
the cluster secret comes from the config, the environment or `duet serve`, and the settings that
can only fail on a worker's own node (its interface, its port) fail there naming the field."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from cluster.config import config_from_dict
from cluster.transfer_setup import cluster_secret, make_publisher, transceiver_config
from tests.tiny_engine import tiny_engine
from transfer import FaultInjection, TransceiverConfig


def test_every_transfer_setting_reaches_the_transceiver() -> None:
    section = {
        "secret": "s3cret",
        "staging_tokens": 64,
        "staging_buffers": 2,
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
        "fault_injection": {"fraction": 0.25, "points": ["before_ack"], "seed": 3},
    }
    got = transceiver_config(config_from_dict({"transfer": section, "stats": {"max_stats_len": 9}}))
    expected = {
        **section,
        "ucx_tls": None,
        "ucx_net_devices": None,
        "ucx_env": None,
        "fault_injection": None,
    }
    for name, value in expected.items():
        if value is not None:
            assert getattr(got, name) == value, name
    assert got.ucx_env == {
        "UCX_RNDV_THRESH": "8192",
        "UCX_TLS": "tcp,self",
        "UCX_NET_DEVICES": "lo",
    }
    assert got.fault_injection == FaultInjection(0.25, ("before_ack",), 3)
    assert got.max_stats_len == 9
    unset = {f.name for f in dataclasses.fields(TransceiverConfig)} - set(section)
    assert unset == {"max_stats_len"}  # from the stats section
    lo = transceiver_config(config_from_dict({"transfer": {"interface": "lo"}}), secret="x")
    assert lo.host == "127.0.0.1" and lo.secret == "x"
    every = transceiver_config(config_from_dict({"stats": {"max_stats_len": -1}}), secret="x")
    assert every.max_stats_len == 1000  # transfer records are never drained in the cluster


def test_the_secret_comes_from_the_config_the_environment_or_duet_serve(monkeypatch) -> None:
    monkeypatch.delenv("DUET_TRANSFER_SECRET", raising=False)
    plain = config_from_dict({})
    with pytest.raises(
        ValueError, match="no transfer secret: set transfer.secret or DUET_TRANSFER_SECRET"
    ):
        cluster_secret(plain)
    made = cluster_secret(plain, make=True)
    assert len(made) >= 32 and made != cluster_secret(plain, make=True)  # fresh per cluster
    monkeypatch.setenv("DUET_TRANSFER_SECRET", "from-env")
    assert cluster_secret(plain) == "from-env" == transceiver_config(plain).secret
    assert cluster_secret(config_from_dict({"transfer": {"secret": "from-yaml"}})) == "from-yaml"


def test_an_interface_or_port_that_fails_on_this_node_names_its_field() -> None:
    with pytest.raises(ValueError, match="transfer.interface 'nosuch0': no IPv4 address"):
        transceiver_config(config_from_dict({"transfer": {"interface": "nosuch0"}}), secret="x")
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        config = config_from_dict({"transfer": {"port": port}})
        with pytest.raises(ValueError, match=rf"transfer.host / port \(127.0.0.1:{port}\)"):
            make_publisher(tiny_engine(16), config, lambda rid: None, secret="x")
    finally:
        taken.close()
