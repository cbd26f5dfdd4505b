"""What `duet bench` sends with every request besides the prompt: the server's API key, more
headers, sampling settings and an extra body (cluster/bench/options.py, sweep.py, client.py),
against a real HTTP server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cluster.bench.cli import parse_bench_args, run_bench
from cluster.bench.target import ConfigTarget

SMALL = "--num-prompts 2 --input-len 4 --output-len 4 --tokenizer none --vocab-size 50 --disable-tqdm --no-plots".split()
CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def bench(argv: list[str], out: Path) -> tuple[int, dict[str, Any]]:
    code = run_bench(parse_bench_args([*argv, *SMALL, "--output-dir", str(out)]))
    return code, json.loads((out / "results.json").read_text())


def test_a_server_with_an_api_key(
    start_echo: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every request carried no key: a server started with one refused them all, /perf_metrics
    too, and the driver said the server listed no model."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with start_echo(api_key="sesame") as server:
        code, results = bench([server.url], tmp_path / "none")
        assert code == 1
        assert results["error"] == (
            f"the server at {server.url} refused a request without an API key (HTTP 401 on "
            "GET /v1/models): give --api-key (or OPENAI_API_KEY)"
        )
        code, results = bench([server.url, "--api-key", "wrong"], tmp_path / "wrong")
        assert code == 1 and "refused the API key given" in results["error"]
        for how, extra in [
            ("flag", ["--api-key", "sesame"]),
            ("header", ["--header", "Authorization=Bearer sesame"]),
            ("env", []),
        ]:
            if how == "env":
                monkeypatch.setenv("OPENAI_API_KEY", "sesame")
            code, results = bench([server.url, *extra], tmp_path / how)
            assert code == 0, (how, results["error"])
            [run] = results["targets"][0]["runs"]
            assert run["completed"] == 2 and run["num_server_metrics"] == 2, how  # (perf too)


def test_a_config_targets_own_api_key_is_used(tmp_path: Path) -> None:
    config = tmp_path / "keyed.yaml"
    text = (CONFIGS / "local_aggregated.yaml").read_text()
    config.write_text(text.replace("server:\n", "server:\n  api_key: sesame\n", 1))
    assert ConfigTarget(config, "x").api_key == "sesame"
    assert ConfigTarget(CONFIGS / "local_aggregated.yaml", "x").api_key is None


def test_sampling_flags_and_extra_body_join_every_body(start_echo: Any, tmp_path: Path) -> None:
    with start_echo() as server:
        argv = [server.url, "--top-k", "5", "--min-p", "0.1",
                "--extra-body", '{"top_k": 7, "min_tokens": 1}']  # fmt: skip
        code, results = bench(argv, tmp_path / "a")
        assert code == 0, results["error"]
        bodies = server.state.bodies[-2:]  # (the measured ones, after the warm-up)
        assert all((b["top_k"], b["min_p"], b["min_tokens"]) == (7, 0.1, 1) for b in bodies)
        assert results["extra_body"] == {"top_k": 7, "min_p": 0.1, "min_tokens": 1}
        assert all(b["temperature"] == 0.0 and b["stream"] is True for b in bodies)
    code, results = bench(
        ["http://127.0.0.1:9", "--extra-body", '{"stream": false}'], tmp_path / "b"
    )
    assert code == 1 and results["error"].endswith(
        "--extra-body may not set stream: the driver does"
    )
    with pytest.raises(SystemExit):
        parse_bench_args(["--extra-body", "[1]"])
    code, results = bench(["http://127.0.0.1:9", "--header", "novalue"], tmp_path / "c")
    assert code == 1 and results["error"].endswith("--header 'novalue': expected KEY=VALUE")
