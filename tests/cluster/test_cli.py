"""The duet CLI, run in-process through main(argv): exit codes and what it prints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cluster import cli
from cluster.config import ClusterConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_validate_ok(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(CONFIGS / "local.yaml")
    assert cli.main(["config", "validate", path]) == 0
    out, err = capsys.readouterr()
    assert out == (f"OK {path} (disaggregated, 1 prefill, 1 decode, model SmolLM2-135M-Instruct)\n")
    assert err == ""


def test_validate_bad_config_prints_every_issue_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill: {replicas: -1}\nservr: {}\n")
    assert cli.main(["config", "validate", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"invalid config {bad}:",
        "  prefill.replicas: must be >= 0, got -1",
        "  servr: unknown key (did you mean 'server'?); allowed: decode, kvcache, model, "
        "prefill, ray, router, server, stats, transfer",
    ]


def test_validate_refuses_a_weak_secret_in_the_environment_as_serve_does(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DUET_TRANSFER_SECRET too short: `duet serve` exits 2 on it, so validate does; an
    aggregated config (no transfer) does not read it."""
    monkeypatch.setenv("DUET_TRANSFER_SECRET", "short-env-secret")
    assert cli.main(["config", "validate", str(CONFIGS / "local.yaml")]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "DUET_TRANSFER_SECRET must be at least 32 characters" in err
    assert "short-env-secret" not in err
    assert cli.main(["config", "validate", str(CONFIGS / "local_aggregated.yaml")]) == 0


def test_validate_several_files_fails_if_any_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = str(CONFIGS / "local_aggregated.yaml")
    missing = str(tmp_path / "missing.yaml")
    assert cli.main(["config", "validate", good, missing]) == 2
    out, err = capsys.readouterr()
    assert out.startswith(f"OK {good} (aggregated, 2 decode, ")
    assert err.splitlines() == [
        f"invalid config {missing}:",
        "  cannot read file: No such file or directory",
    ]


def test_schema_is_the_cluster_config_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema == ClusterConfig.model_json_schema()
    assert schema["additionalProperties"] is False
    assert list(schema["properties"]) == [
        "model", "prefill", "decode", "kvcache", "transfer", "router", "server", "stats", "ray",
    ]  # fmt: skip


def test_serve_with_a_bad_config_exits_2_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode: {replicas: 0}\n")
    serve_loaded_before = "cluster.serve" in sys.modules
    assert cli.main(["serve", str(bad)]) == 2
    assert "decode.replicas: must be >= 1, got 0" in capsys.readouterr().err
    assert ("cluster.serve" in sys.modules) == serve_loaded_before  # the config failed first


def test_bench_arguments_go_to_the_bench_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["bench", "--help"])
    assert caught.value.code == 0
    assert capsys.readouterr().out.startswith("usage: duet bench ")


@pytest.mark.parametrize(
    "argv",
    [[], ["config"], ["config", "validate"], ["nonsense"], ["config", "schema", "--extra"]],
)
def test_bad_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(argv)
    assert caught.value.code == 2
    assert "usage: duet" in capsys.readouterr().err


def test_optional_module_missing_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._import_optional("cluster.no_such_module", "duet thing") is None
    assert capsys.readouterr().err == (
        "duet thing is not available: module cluster.no_such_module is missing\n"
    )
    assert cli._import_optional("cluster.config", "duet config") is sys.modules["cluster.config"]


def test_missing_dependency_inside_an_optional_module_still_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "duet_cli_broken_module.py").write_text("import duet_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="duet_no_such_dependency"):
        cli._import_optional("duet_cli_broken_module", "duet thing")


def test_set_overrides_the_file_and_is_checked_as_the_file(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = str(CONFIGS / "local.yaml")
    assert cli.main(["config", "validate", path, "--set", "decode.replicas=3"]) == 0
    assert "1 prefill, 3 decode" in capsys.readouterr().out
    assert cli.main(["config", "validate", path, "--set", "server.prot=1"]) == 2
    err = capsys.readouterr().err
    assert f"invalid config {path} with --set server.prot=1:" in err
    assert "server.prot: unknown key (did you mean 'port'?)" in err


def test_serve_takes_overrides_and_vllms_host_and_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cluster.serve

    served = []
    monkeypatch.setattr(cluster.serve, "serve", served.append)  # (the config it would start)
    argv = ["serve", str(CONFIGS / "local.yaml"), "--set", "decode.replicas=2", "--port", "0"]
    assert cli.main(argv) == 0
    assert cli.main(["serve", str(CONFIGS / "local.yaml"), "--host", "127.0.0.2"]) == 0
    first, second = served
    assert (first.decode.replicas, first.server.port, first.server.host) == (2, 0, "127.0.0.1")
    assert (second.decode.replicas, second.server.port, second.server.host) == (
        1,
        8000,
        "127.0.0.2",
    )
