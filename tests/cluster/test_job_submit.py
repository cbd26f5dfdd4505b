"""`ray job submit --working-dir . -- duet serve CONFIG` against a `ray start --head` on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cluster.cluster_fixtures import REPO

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, deadline_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {deadline_s}s")


def test_ray_job_submit_serves_a_request(tmp_path: Path) -> None:
    gcs, dash, http = _free_port(), _free_port(), _free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PATH=f"{BIN}:{os.environ['PATH']}")
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            "--num-cpus=3",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--temp-dir={tmp_path / 'ray'}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    config["server"]["port"] = http
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(config))
    job = None
    try:
        _wait_http(f"http://127.0.0.1:{dash}/api/version", 120, head)
        job = subprocess.Popen(
            [
                str(BIN / "ray"),
                "job",
                "submit",
                f"--address=http://127.0.0.1:{dash}",
                "--working-dir",
                str(REPO),
                "--",
                "duet",
                "serve",
                str(config_path),
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        _wait_http(f"http://127.0.0.1:{http}/health", 300, job)
        r = httpx.post(
            f"http://127.0.0.1:{http}/v1/completions",
            json={
                "model": "SmolLM2-135M-Instruct",
                "prompt": "The capital of France is",
                "max_tokens": 6,
                "temperature": 0,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].strip()
    finally:
        if job is not None and job.poll() is None:
            job.terminate()
            job.wait(30)
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(30)
