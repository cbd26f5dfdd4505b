"""The ``transfer`` section's own rules (cluster/config/transfer.py): staging chunks of whole pages,
UCX settings, the secret, the failure policy and fault injection."""

from __future__ import annotations

import pytest

from cluster.config import TransferConfig, config_from_dict
from tests.cluster.conftest import issues_of


def test_chunks_hold_whole_pages() -> None:
    assert issues_of({"kvcache": {"page_size": 32}, "transfer": {"staging_tokens": 1000}}) == [
        "transfer.staging_tokens: must be a multiple of kvcache.page_size (32), got 1000"
    ]


def test_transfer_rules_and_ucx_environment() -> None:
    transfer = TransferConfig(
        ucx_tls=["tcp", "cuda_copy", "cuda_ipc"],  # type: ignore[arg-type]
        ucx_net_devices="lo",
        ucx_env={"UCX_RNDV_THRESH": "8192"},
    )
    assert transfer.ucx_environment == {
        "UCX_RNDV_THRESH": "8192",
        "UCX_TLS": "tcp,cuda_copy,cuda_ipc",
        "UCX_NET_DEVICES": "lo",
    }
    # One host (a loopback host, the default): UCX listens on loopback only, as every other
    # listener does (UCX's TCP transport listened on every interface); across hosts UCX picks.
    assert TransferConfig().ucx_environment == {"UCX_NET_DEVICES": "lo"}
    assert TransferConfig(host="::1").ucx_environment == {"UCX_NET_DEVICES": "lo"}
    assert TransferConfig(host="10.0.0.1").ucx_environment == {}
    assert TransferConfig(interface="eth0").ucx_environment == {}
    data = {
        "transfer": {
            "host": "10.0.0.1",
            "interface": "eth0",
            "lease_s": 5,
            "ucx_tls": ["tcp", "CUDA"],
            "ucx_env": {"UCX_TLS": "tcp", "OMP_NUM_THREADS": "1"},
        }
    }
    assert issues_of(data) == [
        "transfer.ucx_tls: transport names are lower-case words like 'tcp' or 'cuda_ipc', got ['CUDA']",
        "transfer.ucx_env: keys must start with 'UCX_', got ['OMP_NUM_THREADS']",
    ]
    data = {"transfer": {"host": "10.0.0.1", "interface": "eth0", "lease_s": 5}}
    assert issues_of(data) == [
        "transfer.interface: not allowed together with host (pick one)",
        "transfer.lease_s: must be >= connect_deadline_s and pull_deadline_s (30.0): a shorter "
        "lease can expire while the decode worker is still within its deadline, got 5.0",
    ]
    assert config_from_dict({"transfer": {"interface": "eth0"}}).transfer.interface == "eth0"


def test_transfer_settings_that_would_validate_and_then_fail() -> None:
    # Each of these used to pass validation and then fail (or quietly degrade) at run time.
    def issue(**transfer: object) -> list[str]:
        return issues_of({"transfer": transfer})

    assert "must include 'tcp'" in issue(ucx_tls=["sm"])[0]  # peer error handling drops sm
    assert "first name only" in issue(ucx_tls=["tcp", "^sm"])[0]
    assert "must not exclude 'tcp'" in issue(ucx_tls=["^tcp"])[0]  # (^ applies to the list)
    assert "must not exclude 'tcp'" in issue(ucx_tls=["^sm", "tcp"])[0]
    # UCX only warns about a transport it does not know: a typo would quietly drop cuda_ipc.
    assert issue(ucx_tls=["tcp", "cuda_ipcc"]) == [
        "transfer.ucx_tls: not UCX transports: 'cuda_ipcc' (did you mean 'cuda_ipc'?); UCX would "
        "only warn and run without them"
    ]
    assert "'tcpp' (did you mean 'tcp'?)" in issue(ucx_tls=["tcpp", "^shmm"])[0]
    for fine in (["^sm"], ["all"], ["tcp", "cuda", "gdr_copy"], ["tcp", "some_new_transport"]):
        assert config_from_dict({"transfer": {"ucx_tls": fine}}).transfer.ucx_tls == tuple(fine)
    assert "an address they can dial" in issue(host="0.0.0.0")[0]  # advertised in tickets
    got = config_from_dict({"transfer": {"ucx_env": {"UCX_MAX_RNDV_RAILS": 1, "UCX_X": True}}})
    assert got.transfer.ucx_env == {"UCX_MAX_RNDV_RAILS": "1", "UCX_X": "y"}  # YAML scalars
    tuned = config_from_dict(
        {"transfer": {"staging_buffers": 2, "progress_mode": "thread-polling"}}
    ).transfer
    assert (tuned.staging_buffers, tuned.progress_mode) == (2, "thread-polling")
    two = {"prefill": {"replicas": 2}, "transfer": {"port": 5555}}
    assert "cannot all listen on port 5555" in issues_of(two)[0]  # the second failed to bind
    with pytest.MonkeyPatch.context() as env:  # the Ray cluster of `ray job submit`'s job
        env.setenv("RAY_ADDRESS", "127.0.0.1:6379")
        assert config_from_dict(two).transfer.port == 5555
    two["ray"] = {"address": "auto"}  # a cluster of nodes: one per node may share the port
    assert config_from_dict(two).transfer.port == 5555
    ranks = {"prefill": {"tensor_parallel_size": 4}, "transfer": {"port": 65533}}
    assert "would listen on 65536 (port + rank)" in issues_of(ranks)[0]  # rank 3
    ranks["transfer"]["port"] = 65532
    assert config_from_dict(ranks).transfer.port == 65532


def test_transfer_secret_failure_policy_and_fault_injection() -> None:
    t = config_from_dict(
        {
            "transfer": {
                "secret": "s3cret-" + "x" * 26,
                "on_failure": "recompute",
                "fault_injection": {"fraction": 0.1, "points": ["connect", "mid_data"], "seed": 4},
            }
        }
    ).transfer
    assert t.secret is not None and t.secret.get_secret_value() == "s3cret-" + "x" * 26
    assert "s3cret" not in repr(t) and "s3cret" not in str(t.model_dump(mode="json"))
    assert (t.on_failure, t.fault_injection.fraction, t.fault_injection.points) == (
        "recompute",
        0.1,
        ("connect", "mid_data"),
    )
    assert config_from_dict({}).transfer.fault_injection.fraction == 0.0  # off by default
    # (an empty secret used to pass here, win over DUET_TRANSFER_SECRET, and fail the build)
    assert "must not be empty" in issues_of({"transfer": {"secret": ""}})[0]
    # P proves the secret to whoever connects: a short one could be guessed offline
    assert "at least 32 characters" in issues_of({"transfer": {"secret": "hunter2"}})[0]
    assert issues_of({"transfer": {"on_failure": "retry"}})[0].startswith("transfer.on_failure")
    assert issues_of({"transfer": {"fault_injection": {"fraction": 2}}})[0].startswith(
        "transfer.fault_injection.fraction"
    )
    assert issues_of({"transfer": {"fault_injection": {"points": ["nowhere"]}}})[0].startswith(
        "transfer.fault_injection.points"
    )
