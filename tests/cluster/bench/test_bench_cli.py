"""`duet bench` end to end against real HTTP servers: results JSON, plots, and the error paths."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cluster.bench.cli import parse_bench_args, run_bench

SMALL = "--num-prompts 6 --input-len 8 --output-len 4 --tokenizer none --vocab-size 50 --disable-tqdm".split()


def bench(argv: list[str], out: Path) -> tuple[int, dict[str, Any]]:
    code = run_bench(parse_bench_args([*argv, "--output-dir", str(out)]))
    return code, json.loads((out / "results.json").read_text())


def test_sweep_with_goodput_and_comparison(
    duet_server: Any, peer_server: Any, tmp_path: Path, capsys: Any
) -> None:
    argv = [
        duet_server.url,
        *SMALL,
        "--request-rate",
        "inf",
        "200",
        "--goodput",
        "ttft:60000",
        "tpot:60000",
        "--percentiles",
        "50,99",
        "--compare",
        "aggregated",
        "--compare-target",
        peer_server.url,
    ]
    code, results = bench(argv, tmp_path)
    assert code == 0
    assert results["error"] is None
    assert results["percentiles"] == [50.0, 99.0] and results["goodput_slos"] == {
        "ttft": 60000.0,
        "tpot": 60000.0,
    }
    disagg, agg = results["targets"]
    assert (disagg["label"], agg["label"]) == ("disaggregated", "aggregated")
    assert (disagg["url"], agg["url"], disagg["model_id"]) == (
        duet_server.url,
        peer_server.url,
        "tiny-echo",
    )
    for target in (disagg, agg):
        assert [run["request_rate"] for run in target["runs"]] == [200.0, "inf"]
        for run in target["runs"]:
            assert (run["completed"], run["failed"]) == (6, 0)
            assert (run["total_input_tokens"], run["total_output_tokens"]) == (48, 24)
            assert run["output_lens"] == [4] * 6 and run["errors"] == [""] * 6
            assert run["slo_attainment"] == 1.0
            assert run["p99_ttft_ms"] >= run["median_ttft_ms"] > 0.0
            assert len(run["itls"]) == 6 and all(len(gaps) == 3 for gaps in run["itls"])
        assert (target["goodput"], target["goodput_is_lower_bound"]) == ("inf", True)
    # only the Duet-like server has /perf_metrics: 8 prompt tokens -> 8000 bytes, 0.016 s prefill
    assert [run["num_server_metrics"] for run in disagg["runs"]] == [6, 6]
    assert disagg["runs"][0]["mean_transfer_bytes"] == 8000.0
    assert disagg["runs"][0]["mean_prefill_ms"] == pytest.approx(16.0)
    assert [run["num_server_metrics"] for run in agg["runs"]] == [0, 0]
    assert len(results["comparison"]) == 2 * 7 + 1  # seven metrics per rate, and goodput
    assert results["comparison"][-1] == {
        "request_rate": None,
        "metric": "goodput req/s (a lower bound)",
        "key": "goodput",
        "disaggregated": "inf",
        "aggregated": "inf",
        "ratio": None,
    }
    assert {row["metric"] for row in results["comparison"]} >= {
        "out tok/s",
        "TTFT p99 ms",
        "TPOT median ms",
    }
    for name in (
        "latency_cdf.png",
        "latency_vs_rate.png",
        "goodput_vs_rate.png",
        "disagg_vs_agg.png",
    ):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert (
        "== disaggregated vs aggregated" in printed
        and "even with every request sent at once (rate inf)" in printed
    )


def test_unreachable_server(free_port: int, tmp_path: Path, capsys: Any) -> None:
    url = f"http://127.0.0.1:{free_port}"
    code, results = bench([url, *SMALL], tmp_path)
    assert code == 1
    assert results["error"].startswith(f"cannot reach the server at {url}")
    assert results["targets"] == [{"label": url, "url": url, "runs": []}]
    assert f"duet bench: error: cannot reach the server at {url}" in capsys.readouterr().err


def test_invalid_slo_fails_before_any_request(duet_server: Any, tmp_path: Path) -> None:
    sent_before = duet_server.state.num_requests
    code, results = bench([duet_server.url, *SMALL, "--goodput", "ttft=500"], tmp_path)
    assert code == 1
    assert (
        results["error"] == "bad SLO 'ttft=500': expected KEY:MS with KEY one of ttft, tpot, e2el"
    )
    assert results["targets"] == []
    assert duet_server.state.num_requests == sent_before


def test_bad_workload_line(duet_server: Any, tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "w1 w2"}\n{"prompt": 5}\n', encoding="utf-8")
    argv = [
        duet_server.url,
        "--workload",
        "jsonl",
        "--dataset-path",
        str(path),
        "--tokenizer",
        "none",
        "--disable-tqdm",
    ]
    code, results = bench(argv, tmp_path / "out")
    assert code == 1
    assert results["error"].startswith(f"{path}:2: 'prompt' must be")
    assert results["targets"] == []


def test_chat_random_workload_needs_a_tokenizer(duet_server: Any, tmp_path: Path) -> None:
    code, results = bench([duet_server.url, *SMALL, "--endpoint", "chat"], tmp_path)
    assert (
        code == 1
        and results["error"]
        == "random prompts for the chat endpoint must be text: they need a tokenizer"
    )


def test_results_of_the_first_target_survive_a_failing_second(
    duet_server: Any, free_port: int, tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port}"
    argv = [
        duet_server.url,
        *SMALL,
        "--compare",
        "aggregated",
        "--compare-target",
        dead,
        "--no-plots",
    ]
    code, results = bench(argv, tmp_path)
    assert code == 1
    assert "cannot reach the server" in results["error"]
    first, second = results["targets"]
    assert [run["completed"] for run in first["runs"]] == [6]
    assert second == {"label": "aggregated", "url": dead, "runs": []}
    assert results["comparison"] == []
    assert not (tmp_path / "latency_cdf.png").exists()


def test_plots_go_to_output_dir_and_beside_a_result_file_given_alone(
    duet_server: Any, tmp_path: Path
) -> None:
    """--output-dir says where the plots go, also with --result-file (it named results.json's
    path and the plots went beside it, --output-dir unread)."""
    both = [duet_server.url, *SMALL, "--result-file", str(tmp_path / "r" / "x.json")]
    assert run_bench(parse_bench_args([*both, "--output-dir", str(tmp_path / "plots")])) == 0
    assert (tmp_path / "r" / "x.json").exists() and not (
        tmp_path / "plots" / "results.json"
    ).exists()
    assert (tmp_path / "plots" / "latency_cdf.png").exists()
    assert not (tmp_path / "r" / "latency_cdf.png").exists()
    alone = [duet_server.url, *SMALL, "--result-file", str(tmp_path / "s" / "y.json")]
    assert run_bench(parse_bench_args(alone)) == 0
    assert (tmp_path / "s" / "latency_cdf.png").exists()


def test_sweep_stops_when_every_request_fails(duet_server: Any, tmp_path: Path) -> None:
    path = tmp_path / "failing.jsonl"
    path.write_text(
        '{"prompt": [1, 2], "output_len": 13}\n' * 3, encoding="utf-8"
    )  # the server answers 500
    argv = [
        duet_server.url,
        "--workload",
        "jsonl",
        "--dataset-path",
        str(path),
        "--num-prompts",
        "3",
        "--tokenizer",
        "none",
        "--disable-tqdm",
        "--request-rate",
        "100",
        "inf",
    ]
    code, results = bench(argv, tmp_path / "out")
    assert code == 1
    assert results["error"].startswith(
        f"every request to {duet_server.url} failed at 100 req/s; the first error: HTTP 500"
    )
    [run] = results["targets"][0]["runs"]  # the second rate never ran
    assert (run["completed"], run["failed"], run["request_rate"]) == (0, 3, 100.0)


def test_bad_tokenizer_and_settings(duet_server: Any, tmp_path: Path) -> None:
    missing = tmp_path / "tokenizer.json"
    code, results = bench(
        [duet_server.url, "--tokenizer", str(missing), "--disable-tqdm"], tmp_path / "a"
    )
    assert code == 1 and results["error"].startswith(f"cannot load the tokenizer {missing}: ")
    code, results = bench([duet_server.url, *SMALL, "--percentiles", "50,x"], tmp_path / "b")
    assert code == 1 and results["error"].startswith("bad benchmark settings: bad percentile 'x'")
    code, results = bench([duet_server.url, "--vocab-size", "10"], tmp_path / "c")
    assert code == 1 and "use it with --tokenizer none" in results["error"]
    # A ramp-up at rate inf (the default) would be written down and not happen.
    code, results = bench([duet_server.url, *SMALL, "--ramp-up-seconds", "30"], tmp_path / "d")
    assert code == 1 and "at rate inf every request is sent at once" in results["error"]


def test_bad_request_rate_is_a_usage_error(capsys: Any) -> None:
    with pytest.raises(SystemExit) as info:
        parse_bench_args(["--request-rate", "0"])
    assert info.value.code == 2
    assert "bad request rate '0': must be > 0 (or inf)" in capsys.readouterr().err


def test_multi_turn_workload_through_the_cli(duet_server: Any, tmp_path: Path) -> None:
    argv = [duet_server.url, *SMALL, "--workload", "multi-turn", "--num-turns", "3"]
    code, results = bench([*argv, "--turn-len", "5", "--no-plots"], tmp_path / "a")
    assert code == 0, results["error"]
    workload = results["workload"]
    assert (workload["name"], workload["num_turns"], workload["turn_len"]) == ("multi-turn", 3, 5)
    assert workload["mean_prompt_len"] == (8 + 17 + 26) / 3  # 8, +4 answer +5, +4 +5
    assert results["targets"][0]["runs"][0]["completed"] == 6
    code, results = bench([*argv, "--num-prompts", "7"], tmp_path / "b")
    assert code == 1 and "must be a multiple of --num-turns (3" in results["error"]


@pytest.mark.parametrize("fresh", [False, True])
def test_fresh_prompts_per_rate(start_echo: Any, tmp_path: Path, fresh: bool) -> None:
    """With --fresh-prompts-per-rate no rate repeats a prompt of another (no prefix-cache help
    across rates); without it every rate sends the same prompts."""
    with start_echo() as server:
        argv = [server.url, *SMALL, "--request-rate", "inf", "300", "--num-warmups", "0"]
        code, results = bench([*argv, *(["--fresh-prompts-per-rate"] if fresh else [])], tmp_path)
        assert code == 0 and results["error"] is None
        first, second = (
            {json.dumps(p) for p in server.state.prompts[i * 6 : (i + 1) * 6]} for i in (0, 1)
        )
        assert len(server.state.prompts) == 12 and len(first) == len(second) == 6
        assert (first & second == set()) if fresh else (first == second)


def test_fresh_prompts_per_rate_from_a_file_and_a_warm_up_no_rate_shares(
    start_echo: Any, tmp_path: Path
) -> None:
    """A jsonl workload gives each rate the file's next --num-prompts prompts (it used to give
    every rate the same ones); a file too short for every rate is refused before any request. The
    warm-up's prompt is no measured request's."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(f'{{"prompt": [{i}, {i}, 7]}}\n' for i in range(1, 13)), "utf-8")
    common = ["--workload", "jsonl", "--dataset-path", str(path), "--num-prompts", "6"]
    common += ["--tokenizer", "none", "--disable-tqdm", "--fresh-prompts-per-rate"]
    with start_echo() as server:
        argv = [server.url, *common, "--request-rate", "inf", "300"]
        code, results = bench(argv, tmp_path / "two")
        assert code == 0 and results["error"] is None
        warm, *sent = [json.dumps(p) for p in server.state.prompts]
        assert len(sent) == 12 and len(set(sent)) == 12  # every prompt of the file, once
        assert warm == json.dumps([7, 1, 1]) and warm not in sent
        count = len(server.state.prompts)
        code, results = bench([*argv, "600"], tmp_path / "three")
        assert code == 1 and "too few prompts for rate 3" in results["error"]
        assert len(server.state.prompts) == count  # nothing sent


def test_a_server_still_starting_is_waited_for(
    start_echo: Any, free_port: int, tmp_path: Path
) -> None:
    """`vllm bench serve --ready-check-timeout-sec`: a server that comes up after the driver
    started is asked again until it answers (without the flag, one that does not answer fails
    the benchmark at once: test_unreachable_server)."""
    url = f"http://127.0.0.1:{free_port}"
    up, done = threading.Event(), threading.Event()

    def start_late() -> None:
        time.sleep(1.5)  # (after the driver's first try)
        with start_echo(port=free_port):
            up.set()
            done.wait(60)

    thread = threading.Thread(target=start_late)
    thread.start()
    try:
        code, results = bench([url, *SMALL, "--ready-check-timeout-sec", "60"], tmp_path)
    finally:
        done.set()
        thread.join()
    assert code == 0 and up.is_set(), results["error"]
    assert results["targets"][0]["runs"][0]["completed"] == 6


def test_a_run_that_measured_nothing_keeps_the_earlier_results(
    duet_server: Any, tmp_path: Path, capsys: Any
) -> None:
    """A typo after a good run (a bad --goodput, no server) must not destroy its results.json;
    where no measurement was, the error is written as before."""
    code, good = bench([duet_server.url, *SMALL, "--no-plots"], tmp_path)
    assert code == 0 and good["targets"][0]["runs"]
    capsys.readouterr()
    code = run_bench(
        parse_bench_args(
            [duet_server.url, *SMALL, "--goodput", "ttft=500", "--output-dir", str(tmp_path)]
        )
    )
    assert code == 1
    assert json.loads((tmp_path / "results.json").read_text()) == good
    assert "keeps an earlier run's results" in capsys.readouterr().err
    code, failed = bench([duet_server.url, *SMALL, "--goodput", "ttft=500"], tmp_path / "new")
    assert code == 1 and "bad SLO" in failed["error"] and not failed["targets"]


def test_vllm_bench_backend_names_pick_the_api() -> None:
    assert parse_bench_args(["--backend", "openai-chat"]).endpoint == "chat"
    assert parse_bench_args(["--backend", "vllm"]).endpoint == "completions"
    assert parse_bench_args(["--backend", "vllm", "--endpoint", "chat"]).endpoint == "chat"
    assert parse_bench_args([]).endpoint == "completions"
