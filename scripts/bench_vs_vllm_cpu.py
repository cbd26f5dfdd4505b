"""Duet against vLLM's CPU build on this machine, same workloads, one system at a time, interleaved.

    .venv/bin/python scripts/bench_vs_vllm_cpu.py                 # serving and offline, 3 repetitions
    .venv/bin/python scripts/bench_vs_vllm_cpu.py --reps 5 --only offline
    .venv/bin/python scripts/bench_vs_vllm_cpu.py --duet-config configs/local.yaml  # another Duet server

Not part of `make test` (it takes about 20-30 minutes on 2 cores). The first run also builds vLLM's
CPU build into .bench/vllm-venv and the embedded model as a HF checkpoint (scripts/vllm_cpu_env.py
says how and why), which takes several more minutes.

Serving: `vllm serve CHECKPOINT` and `duet serve CONFIG` (default configs/local_aggregated.yaml),
one server at a time on a free port of 127.0.0.1, each measured by `duet bench URL` with the same
workload: SmolLM2-135M-Instruct float32, --num-prompts random prompts of --input-len tokens and
--output-len output tokens (ignore_eos), sent all at once, then the same count at --extra-rate
requests/s (Poisson). A repetition starts each server once (vLLM compiles for minutes at start) and
runs --runs-per-block benchmark runs on it, each with another seed; the servers take turns, and the
order turns every repetition. Every run of a repetition has a partner with the same seed (the same
prompts) on the other server: figures are paired same-run ratios, Duet over vLLM.

Offline: three worker processes (scripts/offline_generate_worker.py) load vLLM's ``LLM``, Duet's
``engine.LLM`` and HF transformers (batched ``generate``, the 32 prompts in one batch) once each,
warm up on one untimed round, then generate for the same new random prompts every repetition (greedy,
exactly --output-len tokens), in an order that turns every repetition. Output tokens/s and paired
ratios, with the greedy tokens of Duet and vLLM compared to transformers'.

It writes docs/benchmarks/cpu_vs_vllm.md (method, ratios with their spread, the JSON of the run)
and the JSON next to it; the page's hand-written notes are kept across reruns
(scripts/cpu_vs_vllm_page.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import vllm_cpu_env  # noqa: E402
from cpu_vs_vllm_page import kept_notes, render  # noqa: E402

LOGS = vllm_cpu_env.BENCH_DIR / "logs"
MARK = "@@BENCH "


# ---------------------------------------------------------------- processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _duet_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def _stop(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """Interrupt the process group this script started (the server and what it spawned), then kill."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


class Server:
    """One OpenAI-compatible server on a free port, in a process group of its own."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, start_s: float):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        LOGS.mkdir(parents=True, exist_ok=True)
        self.log = open(LOGS / f"server-{name.replace('/', '_')}.log", "a")  # noqa: SIM115
        self.log.write(f"\n==== {datetime.now().isoformat()} {' '.join(cmd)}\n")
        self.log.flush()
        started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while not self._ready():
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {self.proc.returncode}; see {self.log.name}"
                    )
                if time.monotonic() - started > start_s:
                    raise RuntimeError(
                        f"{name} not ready after {start_s:.0f} s; see {self.log.name}"
                    )
                time.sleep(2)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        _stop(self.proc)
        self.log.close()


def start_vllm_server(args: argparse.Namespace, checkpoint: Path) -> Server:
    port = _free_port()
    vllm = vllm_cpu_env.VLLM_VENV / "bin" / "vllm"
    cmd = [str(vllm), "serve", str(checkpoint), "--dtype", "float32"]
    cmd += ["--max-model-len", str(args.max_model_len), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--kv-cache-memory-bytes", str(args.kv_bytes), "--served-model-name", "SmolLM2-135M"]
    cmd += ["--disable-uvicorn-access-log", "--seed", "0"]
    return Server("vllm", cmd, vllm_cpu_env.vllm_env(), port, args.start_timeout)


def start_duet_server(args: argparse.Namespace, config: str) -> Server:
    import yaml

    port = _free_port()
    doc = yaml.safe_load((ROOT / config).read_text())
    doc.setdefault("server", {})["port"] = port
    LOGS.mkdir(parents=True, exist_ok=True)
    path = LOGS / f"serve-{Path(config).stem}-{port}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    cmd = [sys.executable, "-m", "cluster.cli", "serve", str(path)]
    return Server(f"duet:{config}", cmd, _duet_env(), port, args.start_timeout)


# ---------------------------------------------------------------- serving
def bench_url(args: argparse.Namespace, url: str, seed: int, label: str) -> list[dict[str, Any]]:
    """One `duet bench URL` run (every rate); returns the runs of its results file."""
    with tempfile.TemporaryDirectory(dir=vllm_cpu_env.BENCH_DIR) as tmp:
        result = Path(tmp) / "results.json"
        cmd = [sys.executable, "-m", "cluster.bench", url, "--num-prompts", str(args.num_prompts)]
        cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        cmd += ["--request-rate", "inf", *([str(args.extra_rate)] if args.extra_rate else [])]
        cmd += ["--seed", str(seed), "--result-file", str(result), "--no-plots", "--disable-tqdm"]
        cmd += ["--server-metrics-wait", "0", "--run-deadline", "900", "--num-warmups", "1"]
        with open(LOGS / "bench.log", "a") as log:
            log.write(f"\n==== {label} {' '.join(cmd)}\n")
            log.flush()
            subprocess.run(
                cmd,
                env=_duet_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=2400,
                check=False,
            )
        doc = json.loads(result.read_text())
    if doc.get("error"):
        raise RuntimeError(f"duet bench against {label}: {doc['error']}")
    runs = doc["targets"][0]["runs"]
    keep = ("request_rate", "completed", "failed", "duration", "request_throughput")
    keep += ("output_throughput", "median_tpot_ms", "mean_tpot_ms", "p90_tpot_ms")
    keep += ("median_ttft_ms", "p90_ttft_ms", "median_e2el_ms", "median_itl_ms")
    return [{k: run.get(k) for k in keep} for run in runs]


def serving(args: argparse.Namespace, checkpoint: Path, report: dict[str, Any]) -> None:
    systems = ["vllm", *[f"duet:{c}" for c in args.duet_config]]
    for rep in range(args.reps):
        order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
        for name in order:
            print(f"[serving {rep}] starting {name}", flush=True)
            server = (
                start_vllm_server(args, checkpoint)
                if name == "vllm"
                else start_duet_server(args, name.split(":", 1)[1])
            )
            try:
                for i in range(args.runs_per_block):
                    seed = 1000 * (rep + 1) + i
                    for run in bench_url(args, server.url, seed, name):
                        entry = {"rep": rep, "seed": seed, "system": name, **run}
                        entry["server_start_s"] = server.start_seconds
                        report["serving"].append(entry)
                        print(f"[serving {rep}] {name} seed {seed}: {_short(run)}", flush=True)
            finally:
                server.stop()
        _write(args, report)


def _short(run: dict[str, Any]) -> str:
    return (
        f"rate {run['request_rate']}: {run['request_throughput']:.3f} req/s, "
        f"{run['output_throughput']:.1f} out tok/s, TPOT median {run['median_tpot_ms']:.0f} ms, "
        f"TTFT median {run['median_ttft_ms']:.0f} ms"
    )


# ---------------------------------------------------------------- offline
class OfflineWorker:
    """A scripts/offline_generate_worker.py process holding one loaded system."""

    def __init__(
        self,
        system: str,
        python: Path,
        env: dict[str, str],
        checkpoint: Path,
        args: argparse.Namespace,
        threads: int = 0,
    ):
        self.name = system if not threads else f"{system}-t{threads}"
        LOGS.mkdir(parents=True, exist_ok=True)
        self.log = open(LOGS / f"offline-{self.name}.log", "a")  # noqa: SIM115
        cmd = [str(python), str(ROOT / "scripts" / "offline_generate_worker.py")]
        cmd += ["--system", system, "--checkpoint", str(checkpoint), "--threads", str(threads)]
        cmd += ["--max-model-len", str(args.max_model_len), "--kv-bytes", str(args.kv_bytes)]
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
            self.log.write(line)
        raise RuntimeError(f"offline worker {self.name} exited; see {self.log.name}")

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        if self.proc.stdin is not None and self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        _stop(self.proc, grace_s=10)
        self.log.close()


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)  # ids clear of the special tokens at the start of the vocabulary
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


def _same_until_eos(a: list[int], b: list[int], eos: set[int]) -> bool:
    """Equal up to the first EOS of either: past it HF's min_new_tokens bans EOS while the
    engines, ignoring EOS, may sample it, so the sequences may legitimately part there."""
    end = next((i for i, t in enumerate(a) if t in eos), len(a))
    end = min(end, next((i for i, t in enumerate(b) if t in eos), len(b)))
    return a[:end] == b[:end]


def offline(args: argparse.Namespace, checkpoint: Path, report: dict[str, Any]) -> None:
    vllm_python = vllm_cpu_env.vllm_python()
    workers: list[OfflineWorker] = []
    try:
        print("[offline] loading vLLM (it compiles for minutes)", flush=True)
        workers.append(
            OfflineWorker("vllm", vllm_python, vllm_cpu_env.vllm_env(), checkpoint, args)
        )
        for threads in args.duet_threads:
            workers.append(
                OfflineWorker("duet", Path(sys.executable), _duet_env(), checkpoint, args, threads)
            )
        for threads in args.hf_threads:
            workers.append(
                OfflineWorker("hf", Path(sys.executable), _duet_env(), checkpoint, args, threads)
            )
        report["offline_workers"] = {w.name: w.ready for w in workers}
        eos = {2}  # SmolLM2's <|im_end|>, the checkpoint's eos_token_id
        warm = _prompts(7, args.num_prompts, args.input_len)
        for w in workers:
            print(f"[offline] warm-up {w.name}", flush=True)
            w.generate(warm, args.output_len)
        for rep in range(args.reps):
            prompts = _prompts(100 + rep, args.num_prompts, args.input_len)
            shift = rep % len(workers)
            tokens: dict[str, list[list[int]]] = {}
            for w in workers[shift:] + workers[:shift]:
                out = w.generate(prompts, args.output_len)
                tokens[w.name] = out["token_ids"]
                n_out = sum(len(t) for t in out["token_ids"])
                entry = {"rep": rep, "system": w.name, "seconds": out["seconds"]}
                entry.update(cpu_seconds=out["cpu_seconds"], output_tokens=n_out)
                entry["tok_s"] = n_out / out["seconds"]
                report["offline"].append(entry)
                print(
                    f"[offline {rep}] {w.name}: {entry['tok_s']:.1f} out tok/s ({out['seconds']:.1f} s)",
                    flush=True,
                )
            for name, toks in tokens.items():
                oracle = next(t for n, t in tokens.items() if n.startswith("hf"))
                if not name.startswith("hf"):
                    same = sum(
                        _same_until_eos(a, b, eos) for a, b in zip(toks, oracle, strict=True)
                    )
                    report["greedy_equal_to_hf"].append(
                        {"rep": rep, "system": name, "equal": same, "of": len(toks)}
                    )
            _write(args, report)
    finally:
        for w in workers:
            w.stop()


# ---------------------------------------------------------------- report
def _write(args: argparse.Namespace, report: dict[str, Any]) -> None:
    report["meta"]["load_end"] = f"{os.getloadavg()[0]:.2f}"
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    args.out.write_text(render(report, kept_notes(args.out)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3, help="repetitions (the order turns each)")
    parser.add_argument("--only", choices=("serving", "offline"), default=None)
    parser.add_argument("--duet-config", nargs="+", default=["configs/local_aggregated.yaml"])
    parser.add_argument(
        "--duet-threads",
        type=int,
        nargs="+",
        default=[0, 1],
        help="offline Duet workers' torch threads (0: torch's default, the host's cores)",
    )
    parser.add_argument(
        "--hf-threads",
        type=int,
        nargs="+",
        default=[0, 1],
        help="offline HF workers' torch threads (0: torch's default, the host's cores)",
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--extra-rate",
        type=float,
        default=1.0,
        help="a Poisson rate run after the all-at-once run (0: none)",
    )
    parser.add_argument("--runs-per-block", type=int, default=1, help="bench runs per server start")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--kv-bytes", type=int, default=1 << 30, help="vLLM's KV cache (and offline Duet's)"
    )
    parser.add_argument("--start-timeout", type=float, default=1200.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "cpu_vs_vllm.md")
    parser.add_argument(
        "--json", type=Path, default=ROOT / "docs" / "benchmarks" / "cpu_vs_vllm.json"
    )
    args = parser.parse_args()

    vllm_cpu_env.BENCH_DIR.mkdir(exist_ok=True)
    checkpoint = vllm_cpu_env.ensure_checkpoint()
    vllm_python = vllm_cpu_env.ensure_vllm_venv()
    vllm_version = subprocess.run(
        [str(vllm_python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    report: dict[str, Any] = {
        "meta": {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {_cpu_model()}",
            "load_start": f"{os.getloadavg()[0]:.2f}",
            "vllm": f"vllm-cpu {vllm_version}",
            "duet_configs": args.duet_config,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "reps": args.reps,
            "git": subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip(),
        },
        "serving": [],
        "offline": [],
        "offline_workers": {},
        "greedy_equal_to_hf": [],
    }
    if args.only in (None, "offline"):
        offline(args, checkpoint, report)
    if args.only in (None, "serving"):
        serving(args, checkpoint, report)
    _write(args, report)
    print(render(report).split("## The JSON")[0])
    print(f"wrote {args.out} and {args.json}")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
