"""From the ``transfer`` section to the workers' TransceiverConfig: every setting reaches it, the
cluster secret comes from the config, the environment or `duet serve`, and no layer rewrites
``stats.max_stats_len`` on the way."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.config import config_from_dict
from cluster.transfer_secret import cluster_secret
from cluster.transfer_setup import transceiver_config
from transfer import FaultInjection, TransceiverConfig


def test_every_transfer_setting_reaches_the_transceiver() -> None:
    dotted = {
        "transfer.secret": "s3cret-" + "x" * 26,
        "transfer.staging_tokens": 64,
        "transfer.staging_buffers": 2,
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
        "transfer.fault_injection": {"fraction": 0.25, "points": ["before_ack"], "seed": 3},
    }
    section = {path.removeprefix("transfer."): value for path, value in dotted.items()}
    got = transceiver_config(config_from_dict({"transfer": section, "stats": {"max_stats_len": 9}}))
    unlike = ("ucx_tls", "ucx_net_devices", "ucx_env", "fault_injection")  # checked below
    for name, value in section.items():
        if name not in unlike:
            assert getattr(got, name) == value, name
    assert got.ucx_env == {
        "UCX_RNDV_THRESH": "8192",
        "UCX_TLS": "tcp,self",
        "UCX_NET_DEVICES": "lo",
    }
    assert got.fault_injection == FaultInjection(0.25, ("before_ack",), 3)
    assert got.max_stats_len == 9
    assert "s3cret" not in repr(got)  # a spec or config in a log line shows no secret
    unset = {f.name for f in dataclasses.fields(TransceiverConfig)} - set(section)
    assert unset == {"max_stats_len"}  # from the stats section


def test_the_secret_comes_from_the_config_the_environment_or_duet_serve(monkeypatch) -> None:
    monkeypatch.delenv("DUET_TRANSFER_SECRET", raising=False)
    plain = config_from_dict({})
    with pytest.raises(
        ValueError, match="no transfer secret: set transfer.secret or DUET_TRANSFER_SECRET"
    ):
        cluster_secret(plain)
    with pytest.raises(ValueError, match="no transfer secret"):
        transceiver_config(plain)
    made = cluster_secret(plain, make=True)
    assert len(made) >= 32 and made != cluster_secret(plain, make=True)  # fresh per cluster
    assert transceiver_config(plain, secret=made).secret == made  # as `duet serve` hands it over
    from_env, from_yaml = "from-env-" + "e" * 23, "from-yaml-" + "y" * 22
    monkeypatch.setenv("DUET_TRANSFER_SECRET", from_env)
    assert cluster_secret(plain) == from_env == transceiver_config(plain).secret
    assert cluster_secret(config_from_dict({"transfer": {"secret": from_yaml}})) == from_yaml
    monkeypatch.setenv("DUET_TRANSFER_SECRET", "hunter2")  # (guessable offline: refused)
    with pytest.raises(ValueError, match="DUET_TRANSFER_SECRET must be at least 32 characters"):
        cluster_secret(plain)


@pytest.mark.parametrize("max_stats_len", [-1, 0, 5])
def test_transfer_records_follow_stats_max_stats_len_unchanged(max_stats_len: int) -> None:
    config = config_from_dict({"stats": {"max_stats_len": max_stats_len}})
    assert transceiver_config(config, secret="x").max_stats_len == max_stats_len
