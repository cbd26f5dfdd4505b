"""Targets: URLs, configs, and the --compare combinations (cluster/bench/target.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cluster.bench.errors import BenchError
from cluster.bench.target import ConfigTarget, UrlTarget, aggregated_sibling, build_targets

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_url_target() -> None:
    target = UrlTarget("http://127.0.0.1:8000/v1/")
    with target as url:
        assert url == "http://127.0.0.1:8000"
    assert target.label == "http://127.0.0.1:8000" and not target.is_duet
    with pytest.raises(ValueError, match="http://"):
        UrlTarget("127.0.0.1:8000")


def test_build_targets_for_urls() -> None:
    [only] = build_targets("http://a:1/v1", None, None)
    assert isinstance(only, UrlTarget) and only.label == "http://a:1"
    first, second = build_targets("http://a:1", "aggregated", "http://b:2")
    assert (first.label, second.label) == ("disaggregated", "aggregated")
    assert isinstance(second, UrlTarget) and second.url == "http://b:2"
    with pytest.raises(ValueError, match="needs --compare-target"):
        build_targets("http://a:1", "aggregated", None)
    with pytest.raises(ValueError, match="only used with --compare"):
        build_targets("http://a:1", None, "http://b:2")
    with pytest.raises(ValueError, match="only 'aggregated'"):
        build_targets("http://a:1", "peer", "http://b:2")


def test_build_targets_for_configs_uses_the_aggregated_sibling() -> None:
    assert aggregated_sibling("configs/local.yaml") == Path("configs/local_aggregated.yaml")
    first, second = build_targets(str(CONFIGS / "local.yaml"), "aggregated", None)
    assert isinstance(first, ConfigTarget) and isinstance(second, ConfigTarget)
    assert (first.label, second.label) == ("disaggregated", "aggregated")
    assert second.config_path == CONFIGS / "local_aggregated.yaml"
    assert (first.config.aggregated, second.config.aggregated) == (False, True)
    assert first.is_duet and second.is_duet
    [only] = build_targets(str(CONFIGS / "local.yaml"), None, None)
    assert only.label == "local.yaml"


def test_config_compare_checks_modes_and_files(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="must be an aggregated config"):
        build_targets(str(CONFIGS / "local.yaml"), "aggregated", str(CONFIGS / "local.yaml"))
    with pytest.raises(BenchError, match="must be a disaggregated config"):
        build_targets(
            str(CONFIGS / "local_aggregated.yaml"),
            "aggregated",
            str(CONFIGS / "local_aggregated.yaml"),
        )
    lonely = tmp_path / "solo.yaml"
    shutil.copy(CONFIGS / "local.yaml", lonely)
    with pytest.raises(ValueError, match="no .*solo_aggregated.yaml next to"):
        build_targets(str(lonely), "aggregated", None)


def test_config_target_bad_files(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="does not exist"):
        ConfigTarget(tmp_path / "none.yaml", "x")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {sorce: default}\n", encoding="utf-8")
    with pytest.raises(BenchError, match=f"invalid config {bad}"):
        ConfigTarget(bad, "x")
