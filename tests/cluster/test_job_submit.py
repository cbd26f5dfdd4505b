"""`ray job submit --working-dir . -- duet serve CONFIG` against a `ray start --head` on 127.0.0.1."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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


def _wait_http(
    url: str,
    deadline_s: float,
    proc: subprocess.Popen | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {deadline_s}s")


def test_ray_job_submit_serves_a_request(tmp_path: Path) -> None:
    gcs, dash, http = _free_port(), _free_port(), _free_port()
    # Ray's token authentication stays on: head and client share a fresh token through the env.
    env = dict(
        os.environ,
        RAY_USAGE_STATS_ENABLED="0",
        PATH=f"{BIN}:{os.environ['PATH']}",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
    )
    env.pop("RAY_ADDRESS", None)
    # Unix socket paths must stay under ~107 bytes: pytest's tmp_path is too deep for Ray's sockets.
    ray_tmp = tempfile.mkdtemp(prefix="duet-ray-", dir="/tmp")
    head_log = open(tmp_path / "head.log", "w")  # noqa: SIM115 (closed in finally)
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
            f"--temp-dir={ray_tmp}",
        ],
        env=env,
        stdout=head_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    config["server"]["port"] = http
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(config))
    job = None
    try:
        _wait_http(
            f"http://127.0.0.1:{dash}/api/version",
            120,
            head,
            {"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"},
        )
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
        # `ray start --block` stops every process it started (workers and the job too) on SIGINT;
        # it ignores SIGTERM.
        head.send_signal(signal.SIGINT)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(30)
        head_log.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
