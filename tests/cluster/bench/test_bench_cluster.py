"""`duet bench` against the real local Duet cluster: disaggregated and aggregated, side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cluster.bench.cli import parse_bench_args, run_bench

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


pytestmark = pytest.mark.slow


def _copy_config(name: str, out_dir: Path, port: int) -> None:
    """The repo's config with ``server.port`` set to ``port``."""
    data = yaml.safe_load((CONFIGS / name).read_text(encoding="utf-8"))
    data["server"]["port"] = port
    (out_dir / name).write_text(yaml.safe_dump(data), encoding="utf-8")


def test_bench_local_cluster_against_aggregated(tmp_path: Path) -> None:
    """Also with the configs' server.port taken (a `duet serve` of the config beside it): the
    clusters the driver starts serve on free ports and it reads them back (they failed to
    start on the taken port, after loading)."""
    from cluster.serve import listening_socket

    taken = listening_socket("127.0.0.1", 0)
    for name in ("local.yaml", "local_aggregated.yaml"):
        _copy_config(name, tmp_path, taken.getsockname()[1])
    argv = [
        str(tmp_path / "local.yaml"),
        "--compare",
        "aggregated",
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--request-rate",
        "inf",
        "--goodput",
        "ttft:600000",
        "--output-dir",
        str(tmp_path / "out"),
        "--disable-tqdm",
    ]
    try:
        code = run_bench(parse_bench_args(argv))
    finally:
        taken.close()
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert code == 0, results["error"]
    disagg, agg = results["targets"]
    assert (disagg["label"], agg["label"]) == ("disaggregated", "aggregated")
    for target in (disagg, agg):
        [run] = target["runs"]
        assert (run["completed"], run["failed"]) == (4, 0), run["errors"]
        assert (run["total_input_tokens"], run["total_output_tokens"]) == (64, 16)  # ignore_eos
        assert run["output_lens"] == [4, 4, 4, 4]
        assert run["slo_attainment"] == 1.0
        assert run["mean_ttft_ms"] > 0.0 and run["mean_tpot_ms"] > 0.0
    [run] = disagg["runs"]
    assert run["num_server_metrics"] == 4  # every request joined with its /perf_metrics entry
    assert run["total_transfer_bytes"] > 0 and run["mean_prefill_ms"] > 0.0
    assert not agg["runs"][0]["total_transfer_bytes"]  # no KV moves in the aggregated mode
    assert len(results["comparison"]) == 8
    for name in (
        "latency_cdf.png",
        "latency_vs_rate.png",
        "goodput_vs_rate.png",
        "disagg_vs_agg.png",
    ):
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG"
