"""cluster/serve.py: a local Ray started by `duet serve` stays on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Runs as a user's `duet serve` would: no test conftest, so no loopback variable in the environment.
SCRIPT = """
import ray
from cluster.config.loader import load_config
from cluster.serve import connect_ray

assert connect_ray(load_config("configs/local.yaml"))
try:
    print("NODES", sorted({n["NodeManagerAddress"] for n in ray.nodes()}))

    @ray.remote(num_cpus=0)
    def worker_ip() -> str:
        return ray.util.get_node_ip_address()

    print("WORKER", ray.get(worker_ip.remote(), timeout=60))
finally:
    ray.shutdown()
"""


def test_a_local_ray_binds_to_loopback() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    ).stdout
    assert "NODES ['127.0.0.1']" in out, out
    assert "WORKER 127.0.0.1" in out, out
