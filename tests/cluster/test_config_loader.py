"""load_config: YAML in, one ConfigError out that names every bad field path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cluster.config import ConfigError, load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def load_issues(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.source == str(path)
    return caught.value.issues


def test_loads_a_valid_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model: {dtype: bfloat16}\nprefill: {replicas: 0}\nkvcache: {cpu_bytes: 256MiB}\n",
    )
    config = load_config(path)
    assert config.model.dtype == "bfloat16"
    assert config.aggregated
    assert config.kvcache.cpu_bytes == 256 * 2**20


def test_empty_file_means_all_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "# nothing but a comment\n")).decode.replicas == 1


def test_every_bad_field_is_listed_in_one_error(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "prefill:\n  replicas: -1\n"
        "model:\n  dtype: fp8\n  load_format: safetensors\n"
        "server:\n  prot: 8000\n  port: eighty\n",
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    # In the order of ClusterConfig's sections, then of each section's fields.
    assert caught.value.issues == [
        "model.load_format: must be one of 'auto', 'gguf', 'hf', 'dummy', got 'safetensors'",
        "model.dtype: must be one of 'float32', 'bfloat16', 'float16', 'half', 'float', 'auto', got 'fp8'",
        "prefill.replicas: must be >= 0, got -1",
        "server.port: must be an integer, got 'eighty'",
        "server.prot: unknown key (did you mean 'port'?); allowed: api_key, host, "
        "max_request_body_mb, port, request_timeout_s, shutdown_grace_s",
    ]
    assert str(caught.value) == f"invalid config {path}:\n" + "\n".join(
        f"  {issue}" for issue in caught.value.issues
    )


def test_unknown_top_level_section(tmp_path: Path) -> None:
    assert load_issues(write(tmp_path, "routr: {policy: load_balance}\n")) == [
        "routr: unknown key (did you mean 'router'?); allowed: decode, kvcache, model, prefill, "
        "ray, router, server, stats, transfer"
    ]


def test_unknown_key_in_nested_optional_section(tmp_path: Path) -> None:
    text = (
        "model:\n  load_format: dummy\n  dummy_config:\n    hidden_size: 64\n"
        "    intermediate_size: 128\n    num_hidden_layers: 2\n    num_attention_heads: 4\n"
        "    num_key_value_heads: 2\n    vocab_size: 100\n    num_layers: 2\n"
    )
    [issue] = load_issues(write(tmp_path, text))
    assert issue.startswith(
        "model.dummy_config.num_layers: unknown key (did you mean 'num_hidden_layers'?); "
        "allowed: head_dim, hidden_size,"
    )


def test_wrong_types(tmp_path: Path) -> None:
    text = "prefill: 3\ndecode:\n  resources: [1, 2]\nstats:\n  interval_s: soon\n"
    assert load_issues(write(tmp_path, text)) == [
        "prefill: must be a mapping, got int",
        "decode.resources: must be a mapping, got list",
        "stats.interval_s: must be a number, got 'soon'",
    ]


def test_invalid_yaml_names_line_and_column(tmp_path: Path) -> None:
    [issue] = load_issues(write(tmp_path, "model:\n  dtype: float32\n bad: [\n"))
    assert issue == (
        "invalid YAML at line 3, column 2: expected <block end>, but found '<block mapping start>'"
    )


def test_duplicate_keys_are_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "server:\n  port: 8000\n  port: 9000\n")
    assert load_issues(path) == ["invalid YAML at line 3, column 3: duplicate key 'port'"]


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    assert load_issues(write(tmp_path, "- model\n- prefill\n")) == [
        "the top level must be a mapping of sections, got list"
    ]


def test_missing_file(tmp_path: Path) -> None:
    assert load_issues(tmp_path / "absent.yaml") == ["cannot read file: No such file or directory"]
    # a model where the cluster YAML goes (`vllm serve MODEL`'s habit): said what goes where
    (issue,) = load_issues(tmp_path / "HuggingFaceTB" / "SmolLM2-135M-Instruct")
    assert issue.startswith("cannot read file: No such file or directory; a cluster YAML goes")
    assert "model.source" in issue


def test_overrides_set_fields_read_as_yaml_before_validation(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("decode: {replicas: 1}\nserver: {port: 8000}\n")
    config = load_config(
        path,
        [
            "server.port=8001",
            "decode.scheduler.max_num_seqs=7",  # (a section the file leaves out)
            "kvcache.cpu_bytes=64MiB",
            "decode.replicas=2",
            "decode.replicas=3",  # (a later one wins)
        ],
    )
    assert (config.server.port, config.decode.scheduler.max_num_seqs) == (8001, 7)
    assert (config.kvcache.cpu_bytes, config.decode.replicas) == (64 * 2**20, 3)
    assert path.read_text() == "decode: {replicas: 1}\nserver: {port: 8000}\n"  # (untouched)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("server.port", "--set 'server.port': expected PATH=VALUE"),
        ("server..port=1", "--set 'server..port=1': expected PATH=VALUE"),
        ("server.port.x=1", "--set server.port.x=...: server.port is 8000, not a section"),
        ("server.port=[1", "--set server.port=...: the value is not YAML"),
        ("server.port=-1", "server.port: must be >= 0, got -1"),
        ("decode.replica=2", "decode.replica: unknown key (did you mean 'replicas'?)"),
    ],
)
def test_a_bad_override_is_refused_naming_it(tmp_path: Path, override: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("server: {port: 8000}\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path, [override])


@pytest.mark.parametrize(
    ("text", "overrides", "issue"),
    [
        # an unquoted number (YAML reads an int), in the file or by --set; a --set value that
        # YAML reads as a mapping; one that is no YAML at all
        (
            "transfer: {secret: 98237498237498237498}\n",
            [],
            "transfer.secret: must be a string, got int",
        ),
        ("", ["server.api_key=20261206123456"], "server.api_key: must be a string, got int"),
        (
            "",
            ["transfer.secret=hunter2: rest-of-it"],
            "transfer.secret: must be a string, got dict",
        ),
        ("", ["transfer.secret=[hunter2"], "--set transfer.secret=...: the value is not YAML"),
    ],
)
def test_a_bad_secret_is_named_never_shown(
    tmp_path: Path, text: str, overrides: list[str], issue: str
) -> None:
    """transfer.secret and server.api_key: an error names the field and the kind of value, not
    the value (it reaches terminals and CI logs)."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides)
    shown = str(caught.value)
    assert issue in shown
    for leaked in ("98237498237498237498", "20261206123456", "hunter2", "rest-of-it"):
        assert leaked not in shown
