"""From the ``transfer`` section to the workers' TransceiverConfig: every setting reaches it, and
no layer rewrites ``stats.max_stats_len`` on the way."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.config import config_from_dict
from cluster.transfer_setup import transceiver_config
from transfer import TransceiverConfig


def test_every_transfer_setting_reaches_the_transceiver() -> None:
    dotted = {
        "transfer.staging_tokens": 64,
        "transfer.staging_buffers": 2,
        "transfer.piece_chunk_tokens": 256,
        "transfer.direct_copy": False,
        "transfer.lease_s": 40.0,
        "transfer.connect_deadline_s": 3.0,
        "transfer.pull_deadline_s": 4.0,
        "transfer.chunk_deadline_s": 5.0,
        "transfer.done_deadline_s": 6.0,
        "transfer.ack_deadline_s": 7.0,
        "transfer.host": "127.0.0.2",
        "transfer.port": 5555,
        "transfer.progress_mode": "thread-polling",
        "transfer.ucx_tls": ["tcp", "self"],
        "transfer.ucx_net_devices": "lo",
        "transfer.ucx_env": {"UCX_RNDV_THRESH": 8192},
    }
    section = {path.removeprefix("transfer."): value for path, value in dotted.items()}
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


@pytest.mark.parametrize("max_stats_len", [-1, 0, 5])
def test_transfer_records_follow_stats_max_stats_len_unchanged(max_stats_len: int) -> None:
    got = transceiver_config(config_from_dict({"stats": {"max_stats_len": max_stats_len}}))
    assert got.max_stats_len == max_stats_len
