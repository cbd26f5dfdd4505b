"""The README's `ray job submit` recipe, run line by line as a new user would: a Ray head with
token authentication, the server submitted as a job, a request with curl, Ctrl-C.

What the test changes, and only that: HOME is a fresh directory (the token Ray makes lives there,
not in the user's ~/.ray), the virtual environment is the one running the tests, and the fixed
ports of the recipe (Ray's 6379 and 8265, the server's 8000 in configs/local.yaml) become free
ones, so that other tests on this host are not in the way, and Ray is kept on loopback
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, as in every test). Then ``ray.address`` is checked: a
driver whose config names this head's address joins it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cluster.cluster_fixtures import REPO
from tests.ports import free_fixed_port

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def recipe_terminals() -> list[list[str]]:
    """The README recipe's commands, per terminal (each terminal starts at a '# terminal' line)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(
        r"<!-- recipe: ray-job .*?-->\n```bash\n(.*?)```\n<!-- end recipe -->", text, re.S
    )
    assert block, "README.md lost its ray-job recipe"
    terminals: list[list[str]] = []
    for line in block.group(1).splitlines():
        if line.startswith("# terminal"):
            terminals.append([])
        elif line.strip() and not line.startswith("#"):
            terminals[-1].append(line)
    return terminals


def test_the_readme_recipe_has_three_terminals() -> None:
    head, job, client = recipe_terminals()
    assert head[-1].startswith("ray start --head --block") and "export RAY_AUTH_MODE=token" in head
    assert "export RAY_AUTH_MODE=token" in job and job[-1].startswith("ray job submit")
    assert client[0].startswith("curl")


def _wait(predicate, deadline_s: float, what: str, procs: list[subprocess.Popen]) -> None:  # noqa: ANN001
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a recipe terminal exited with {p.returncode}")
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {deadline_s}s")


def test_the_readme_ray_job_recipe_works(tmp_path: Path) -> None:
    head_cmds, job_cmds, client_cmds = recipe_terminals()
    gcs, dash, http = free_fixed_port(), free_fixed_port(), free_fixed_port()
    home = tmp_path / "home"
    home.mkdir()
    # Unix socket paths must stay under ~107 bytes: pytest's tmp_path is too deep for Ray's.
    ray_tmp = tempfile.mkdtemp(prefix="duet-ray-", dir="/tmp")
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    config["server"]["port"] = http
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(config))

    def adapt(line: str) -> str:
        line = line.replace("source .venv/bin/activate", f"source {BIN}/activate")
        if line.startswith("ray start --head"):
            line += f" --port={gcs} --dashboard-port={dash} --temp-dir={ray_tmp} --num-cpus=3"
        line = line.replace("http://127.0.0.1:8265", f"http://127.0.0.1:{dash}")
        line = line.replace("configs/local.yaml", str(config_path))
        return line.replace("http://127.0.0.1:8000", f"http://127.0.0.1:{http}")

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # Loopback only (tests/conftest.py says why Ray needs this variable for it).
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    # Keep this checkout's code in the job (the editable install may point at another one).
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", str(REPO))
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("head", "job")}  # noqa: SIM115

    def terminal(name: str, cmds: list[str]) -> subprocess.Popen:
        script = "set -e\n" + "\n".join(adapt(c) for c in cmds) + "\n"
        return subprocess.Popen(
            ["bash", "-c", script],
            env=env,
            cwd=REPO,
            stdout=logs[name],
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: "Ctrl-C" reaches all of it
        )

    head = terminal("head", head_cmds)
    job = None
    try:
        token_file = home / ".ray" / "auth_token"
        _wait(token_file.exists, 60, "the token", [head])
        auth = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        url = f"http://127.0.0.1:{dash}/api/version"
        _wait(
            lambda: httpx.get(url, headers=auth, timeout=2).status_code == 200,
            120,
            "the head",
            [head],
        )
        for _ in range(10):
            job = terminal("job", job_cmds)
            # Submitted once the CLI says so (it follows the job's logs then). No fixed wait
            # stands for success: on a busy host a submit that fails can take longer than one.
            _wait(
                lambda: (
                    job.poll() is not None  # noqa: B023 (called in this iteration only)
                    or "submitted successfully" in (tmp_path / "job.log").read_text()
                ),
                120,
                "the submission",
                [],
            )
            if job.poll() is None:
                break
            # Ray's dashboard answers before its job agent is up; it says to try again later.
            assert "No available agent" in (tmp_path / "job.log").read_text(), "submit failed"
            time.sleep(2)
        health = f"http://127.0.0.1:{http}/health"
        _wait(
            lambda: httpx.get(health, timeout=2).status_code == 200, 300, "the server", [head, job]
        )
        (curl,) = client_cmds
        out = subprocess.run(
            ["bash", "-c", adapt(curl)], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        assert answer["choices"][0]["text"].strip() and answer["usage"]["completion_tokens"] == 8
        job_log = tmp_path / "job.log"
        _wait(lambda: "Duet serving" in job_log.read_text(), 60, "the job's log", [head, job])

        # ray.address: a driver whose config names the head joins it (token from the same HOME).
        probe = (
            "import ray\n"
            "from cluster.config import config_from_dict\n"
            "from cluster.serve import connect_ray\n"
            f"config = config_from_dict({{'ray': {{'address': '127.0.0.1:{gcs}', 'namespace': 'probe'}}}})\n"
            "assert connect_ray(config) is False\n"  # joined, did not start one
            "print(ray.get_runtime_context().gcs_address, ray.cluster_resources().get('CPU'))\n"
            "ray.shutdown()\n"
        )
        joined = subprocess.run(
            [sys.executable, "-c", probe],
            env={**env, "RAY_AUTH_MODE": "token"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert joined.returncode == 0, joined.stderr[-3000:]
        assert joined.stdout.split()[-2:] == [f"127.0.0.1:{gcs}", "3.0"]
    finally:
        # Ctrl-C in terminal 1: `ray start --block` stops everything it started, the job too.
        for proc in (job, head):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc in (job, head):
            if proc is None:
                continue
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        for log in logs.values():
            log.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
