"""`duet bench --save-result`: each run also as the flat file `vllm bench serve --save-result`
writes (cluster/bench/vllm_result.py), against a real HTTP server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster.bench.cli import parse_bench_args, run_bench

SMALL = "--num-prompts 3 --input-len 4 --output-len 4 --tokenizer none --vocab-size 50 --disable-tqdm --no-plots".split()


def test_each_run_is_saved_in_vllms_layout(
    duet_server: Any, peer_server: Any, tmp_path: Path, capsys: Any
) -> None:
    port = duet_server.url.rsplit(":", 1)[1]
    argv = [
        "--host", "127.0.0.1", "--port", port, *SMALL,
        "--request-rate", "inf", "50",
        "--max-concurrency", "2",
        "--percentiles", "50,99",
        "--compare", "aggregated", "--compare-target", peer_server.url,
        "--output-dir", str(tmp_path / "out"),
        "--save-result", "--result-dir", str(tmp_path / "vllm"), "--label", "mine",
        "--percentile-metrics", "ttft,e2el",
    ]  # fmt: skip
    assert run_bench(parse_bench_args(argv)) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["target"] == duet_server.url
    date = results["date"]
    names = sorted(p.name for p in (tmp_path / "vllm").iterdir())
    assert names == sorted(
        f"mine-{role}-{rate}qps-concurrency2-tiny-echo-{date}.json"
        for role in ("disaggregated", "aggregated")
        for rate in ("50.0", "inf")
    )
    doc = json.loads(
        (
            tmp_path / "vllm" / f"mine-disaggregated-infqps-concurrency2-tiny-echo-{date}.json"
        ).read_text()
    )
    [run] = [r for r in results["targets"][0]["runs"] if r["request_rate"] == "inf"]
    assert {k: doc[k] for k in ("date", "backend", "label", "model_id", "num_prompts")} == {
        "date": date, "backend": "openai", "label": "mine-disaggregated", "model_id": "tiny-echo",
        "num_prompts": 3,
    }  # fmt: skip
    assert (doc["request_rate"], doc["max_concurrency"], doc["completed"]) == ("inf", 2, 3)
    for key in ("duration", "total_output_tokens", "request_throughput", "output_lens", "ttfts",
                "itls", "errors", "mean_ttft_ms", "p99_ttft_ms", "median_e2el_ms", "p50_e2el_ms"):  # fmt: skip
        assert doc[key] == run[key], key
    assert doc["latencies"] == run["e2els"]
    # Only the metrics asked for, as vLLM keeps them; results.json keeps them all.
    assert not any(k.endswith(("_tpot_ms", "_itl_ms")) for k in doc)
    assert "mean_tpot_ms" in run and "tpots" not in doc
    assert "vLLM-layout results: " in capsys.readouterr().out


def test_one_result_filename_for_several_runs_is_refused(duet_server: Any, tmp_path: Path) -> None:
    argv = [duet_server.url, *SMALL, "--request-rate", "inf", "50", "--save-result",
            "--result-filename", "one.json", "--output-dir", str(tmp_path)]  # fmt: skip
    assert run_bench(parse_bench_args(argv)) == 1
    results = json.loads((tmp_path / "results.json").read_text())
    assert "--result-filename names one file, and this command makes 2 runs" in results["error"]
    assert results["targets"] == [] and not (tmp_path / "one.json").exists()
    argv = [duet_server.url, *SMALL, "--save-result", "--result-filename", "one.json",
            "--output-dir", str(tmp_path)]  # fmt: skip
    assert run_bench(parse_bench_args(argv)) == 0
    assert json.loads((tmp_path / "one.json").read_text())["completed"] == 3


def test_its_flags_without_save_result_are_refused(duet_server: Any, tmp_path: Path) -> None:
    argv = [duet_server.url, *SMALL, "--result-dir", "x", "--percentile-metrics", "ttft",
            "--output-dir", str(tmp_path)]  # fmt: skip
    assert run_bench(parse_bench_args(argv)) == 1
    error = json.loads((tmp_path / "results.json").read_text())["error"]
    assert error.endswith("--result-dir, --percentile-metrics: read only with --save-result")
    argv = [duet_server.url, *SMALL, "--save-result", "--percentile-metrics", "ttft,goodput",
            "--output-dir", str(tmp_path)]  # fmt: skip
    assert run_bench(parse_bench_args(argv)) == 1
    error = json.loads((tmp_path / "results.json").read_text())["error"]
    assert "--percentile-metrics 'ttft,goodput': expected some of ttft,tpot,itl,e2el" in error


def test_a_statistic_over_no_values_is_written_as_vllm_writes_it(
    duet_server: Any, tmp_path: Path
) -> None:
    """Every request has one output token, so no TPOT: results.json says null, the vLLM-layout
    file 0.0 (vLLM's np.mean(x or 0)), which scripts made for vLLM's files compute with."""
    port = duet_server.url.rsplit(":", 1)[1]
    small = [
        a if a != "4" or i != SMALL.index("--output-len") + 1 else "1" for i, a in enumerate(SMALL)
    ]
    argv = [
        "--host", "127.0.0.1", "--port", port, *small, "--request-rate", "inf",
        "--output-dir", str(tmp_path / "out"), "--save-result", "--result-dir", str(tmp_path / "v"),
        "--percentile-metrics", "tpot",
    ]  # fmt: skip
    assert run_bench(parse_bench_args(argv)) == 0
    [run] = json.loads((tmp_path / "out" / "results.json").read_text())["targets"][0]["runs"]
    [path] = (tmp_path / "v").iterdir()
    doc = json.loads(path.read_text())
    assert run["mean_tpot_ms"] is None and run["p99_tpot_ms"] is None
    assert (doc["mean_tpot_ms"], doc["median_tpot_ms"], doc["p99_tpot_ms"]) == (0.0, 0.0, 0.0)
