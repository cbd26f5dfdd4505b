"""cluster/serve.py: a local Ray started by `duet serve` stays on loopback (and a Ray already
running is used as it is, the config's ray fields named as not applying); the background HTTP
server ends, and nothing of it runs on, when stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from cluster.serve import start_server_thread, stop_server_thread

REPO = Path(__file__).resolve().parents[2]

# Runs as a user's `duet serve` would: no test conftest, so no loopback variable in the environment.
SCRIPT = """
import logging, sys
import ray
from cluster.config import config_from_dict
from cluster.config.loader import load_config
from cluster.serve import connect_ray

assert connect_ray(load_config("configs/local.yaml"))
try:
    logging.basicConfig(stream=sys.stdout, format="LOG %(message)s")
    assert not connect_ray(config_from_dict({"ray": {"namespace": "elsewhere"}}))
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
    # a second cluster in the same process: the running Ray is used, and its ignored field named
    assert "LOG Ray is already running in this process: ray.namespace of the config" in out, out


def test_a_server_held_open_by_a_stream_is_forced_out_and_its_tasks_end() -> None:
    """A stream that never ends keeps uvicorn's graceful shutdown waiting: stop_server_thread
    forces it out, and the app's background task (the frontend's collector drain, in serving)
    is cancelled with the thread instead of running on after Ray is shut down."""
    ticks: list[float] = []

    async def background() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.02)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):  # noqa: ANN202
        task = asyncio.get_running_loop().create_task(background())
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)

    add_forever_route(app)

    server, thread, port = start_server_thread(app, "127.0.0.1", 0)
    with httpx.stream("GET", f"http://127.0.0.1:{port}/forever", timeout=30) as stream:
        lines = stream.iter_lines()
        assert next(lines) == "0"
        stop_server_thread(server, thread, grace_s=1.0)
        assert not thread.is_alive()
        assert server.force_exit  # the stream kept the graceful shutdown waiting
    count = len(ticks)
    time.sleep(0.2)
    assert len(ticks) == count  # the background task ended with the thread


def test_model_generation_config_picks_the_sampling_defaults(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """model.generation_config: auto reads the checkpoint's generation_config.json (and says in
    the log what it found); none keeps Duet's defaults."""
    from cluster.config import ConfigError, config_from_dict
    from cluster.serve import sampling_defaults
    from engine.loaders.generation_defaults import GenerationDefaults

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.05}'
    )
    auto = config_from_dict({"model": {"source": str(tmp_path)}})
    with caplog.at_level("INFO", logger="cluster.serve"):
        defaults = sampling_defaults(auto)
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.7, 20, None)
    assert defaults.repetition_penalty == 1.05  # (applied, as vLLM applies it)
    assert "temperature=0.7, top_k=20, repetition_penalty=1.05" in caplog.text
    none = config_from_dict({"model": {"source": str(tmp_path), "generation_config": "none"}})
    assert sampling_defaults(none) == GenerationDefaults()
    # A file asking for what no request may have is the config's problem, named before any start.
    (tmp_path / "generation_config.json").write_text('{"top_p": 0}')
    with pytest.raises(ConfigError, match="model.generation_config: auto reads .*top_p"):
        sampling_defaults(auto)
    assert sampling_defaults(none) == GenerationDefaults()


def test_duet_serves_on_the_socket_it_announces() -> None:
    """`duet serve` binds before it prints its address: with port 0 the port taken, not 0."""
    import threading

    import uvicorn

    from cluster.serve import listening_socket

    app = FastAPI()

    @app.get("/")
    async def root() -> str:
        return "here"

    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    assert port != 0
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).json() == "here"
        with pytest.raises(OSError):  # (the port is ours: another bind is refused)
            listening_socket("127.0.0.1", port).close()
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    assert not thread.is_alive()


def test_a_sigterm_cuts_open_streams_after_the_grace_period() -> None:
    """`duet serve`'s uvicorn on SIGTERM (its handler sets should_exit): new connections are
    refused, an open stream gets ``server.shutdown_grace_s`` and is then cut, and the server
    returns by itself (uvicorn's default waited for every stream to end, request_timeout_s
    of them; a supervisor then killed the process with its workers unstopped). The cut is
    uvicorn's one line, not a traceback per stream."""
    import threading

    import uvicorn

    from cluster.config import config_from_dict
    from cluster.serve import listening_socket, serving_config

    app = FastAPI()

    add_forever_route(app)

    config = config_from_dict({"server": {"shutdown_grace_s": 0.5}})
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(serving_config(app, config.server))
    # (after uvicorn's logging set-up, which drops its loggers' handlers; they do not propagate)
    uvicorn_said: list[logging.LogRecord] = []
    keep = logging.Handler()
    keep.emit = uvicorn_said.append  # type: ignore[method-assign]
    logging.getLogger("uvicorn.error").addHandler(keep)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        with httpx.stream("GET", f"http://127.0.0.1:{port}/forever", timeout=30) as stream:
            lines = stream.iter_lines()
            seen.append(next(lines))
            server.handle_exit(signal.SIGTERM, None)
            with contextlib.suppress(httpx.HTTPError):
                seen.extend(lines)
        thread.join(30)
        assert not thread.is_alive() and not server.force_exit
        assert 1 <= len(seen) < 10_000  # cut, not finished
        said = [r.getMessage() for r in uvicorn_said]
        assert any("timeout graceful shutdown exceeded" in m for m in said), said
        assert not any(m.startswith("Exception in ASGI application") for m in said), said
    finally:
        logging.getLogger("uvicorn.error").removeHandler(keep)
        server.force_exit = True
        thread.join(10)
        sock.close()


def test_duet_serves_with_its_log_level() -> None:
    """`duet --log-level WARNING serve` leaves out uvicorn's line per request (its access logger
    has a handler of its own, and uvicorn set it to INFO whatever duet was told)."""
    import logging

    from cluster.config.serving import ServerConfig
    from cluster.serve import serving_config

    root = logging.getLogger()
    saved = root.level, {n: logging.getLogger(n).level for n in ("uvicorn.access", "uvicorn.error")}
    try:
        for level in (logging.WARNING, logging.DEBUG):
            root.setLevel(level)
            serving_config(FastAPI(), ServerConfig())
            assert logging.getLogger("uvicorn.access").isEnabledFor(logging.INFO) == (
                level <= logging.INFO
            )
            assert logging.getLogger("uvicorn.error").isEnabledFor(logging.DEBUG) == (
                level <= logging.DEBUG
            )
    finally:
        root.setLevel(saved[0])
        for name, lvl in saved[1].items():
            logging.getLogger(name).setLevel(lvl)


def test_a_port_taken_is_one_message_before_any_model_loads(capsys) -> None:
    """`duet serve` with its port taken: exit 2 and one line naming server.port, before Ray is
    started or a worker loads a model (it was an OSError traceback after the whole cluster had
    loaded)."""
    import ray

    from cluster.cli import main
    from cluster.serve import listening_socket

    taken = listening_socket("127.0.0.1", 0)
    port = taken.getsockname()[1]
    try:
        code = main(["serve", str(REPO / "configs" / "local.yaml"), "--port", str(port)])
    finally:
        taken.close()
    assert code == 2 and not ray.is_initialized()
    err = capsys.readouterr().err
    assert (
        "server.port / server.host: cannot listen on 127.0.0.1:" in err and "Traceback" not in err
    )


def test_a_server_thread_that_will_not_end_still_has_the_workers_stopped(monkeypatch) -> None:
    """RunningCluster.stop: the workers stop even when the HTTP server's thread does not (they
    stayed, holding the CPUs a later cluster of the process waited for); the error follows."""
    import cluster.serve as serve_module

    stopped: list[str] = []

    class Handles:  # (the one call stop makes on the cluster's handles)
        def shutdown(self) -> None:
            stopped.append("workers")

    def stuck(server: object, thread: object) -> None:
        raise RuntimeError("the HTTP server thread did not end")

    monkeypatch.setattr(serve_module, "stop_server_thread", stuck)
    running = serve_module.RunningCluster("http://127.0.0.1:1", Handles(), None, None, None, False)
    with pytest.raises(RuntimeError, match="did not end"):
        running.stop()
    assert stopped == ["workers"]


def add_forever_route(app: FastAPI) -> None:
    """GET /forever: a stream of a line every 10 ms that a client would have to wait out (100 s)."""

    @app.get("/forever")
    async def forever() -> StreamingResponse:
        async def chunks():  # noqa: ANN202
            for i in range(10_000):  # bounded: 100 s at most
                yield f"{i}\n"
                await asyncio.sleep(0.01)

        return StreamingResponse(chunks())


@pytest.mark.parametrize("source", ["missing.gguf", "garbage.gguf", "empty_dir"])
def test_a_model_source_that_is_none_is_one_message_before_anything_starts(
    source: str, tmp_path: Path, capsys
) -> None:
    """A path that is not there, a file of no model format, a directory with no checkpoint:
    exit 2 and one line naming model.source, before Ray starts (tracebacks, the garbage file's
    after Ray had started; the directory's named model.generation_config)."""
    import ray

    from cluster.cli import main

    (tmp_path / "garbage.gguf").write_bytes(b"not a model" * 100)
    (tmp_path / "empty_dir").mkdir()
    code = main(["serve", str(REPO / "configs" / "local.yaml"), "--port", "0", "--set",
                 f"model.source={tmp_path / source}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and not ray.is_initialized(), err
    assert "model.source: " in err and "Traceback" not in err, err


def test_a_bad_transfer_secret_is_one_message_before_anything_starts(
    capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from cluster.cli import main

    monkeypatch.setenv("DUET_TRANSFER_SECRET", "short")
    code = main(["serve", str(REPO / "configs" / "local.yaml"), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2 and not ray.is_initialized(), err
    assert "transfer.secret: DUET_TRANSFER_SECRET" in err and "Traceback" not in err, err


def test_workers_the_nodes_cannot_hold_are_refused_not_waited_for() -> None:
    """A worker larger than any node (tensor_parallel_size 1 went unchecked), and, when the nodes
    are all there will be (a Ray `duet serve` started here), more workers than they hold
    together: Ray waited for room that never came, for the ready timeout (10 minutes)."""
    from cluster.config import config_from_dict
    from cluster.preflight import RayNode, placement_issues

    host = [RayNode({"CPU": 2.0})]
    big = config_from_dict({"decode": {"resources": {"num_cpus": 4}}})
    assert placement_issues(big, host) == [
        "decode.resources: a worker needs 4 CPU, but the largest node has 2 CPU"
    ]
    many = config_from_dict({"decode": {"replicas": 3, "resources": {"num_cpus": 1}}})
    assert placement_issues(many, host) == []  # (nodes may join: Ray places them as they come)
    (issue,) = placement_issues(many, host, fixed_nodes=True)
    assert issue.startswith("replicas / resources: the workers need 4 CPU in all (prefill: 1 x")
    assert issue.endswith("but this Ray's nodes have 2 CPU")


def test_a_sigterm_while_the_workers_start_stops_everything(tmp_path: Path) -> None:
    """SIGTERM (a supervisor's stop) while `duet serve` starts its workers: Ray's own handler
    aborted the process, its dashboard and runtime-env agents left running. Now everything it
    started stops, and it exits 0 saying so."""
    out = (tmp_path / "serve.log").open("w+")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    serve = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "configs/local.yaml", "--port", "0"],
        cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "Started a local Ray instance" not in (tmp_path / "serve.log").read_text():
            assert serve.poll() is None and time.monotonic() < deadline, (
                tmp_path / "serve.log"
            ).read_text()
            time.sleep(0.2)
        time.sleep(1.0)  # (the workers are being created)
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(120)
        log = (tmp_path / "serve.log").read_text()
        assert code == 0 and "duet serve: stopped (SIGTERM)" in log, log
        assert "Traceback" not in log, log
        # Nothing of its session runs on (Ray's processes are in it: started by it).
        deadline = time.monotonic() + 30
        while _session_processes(serve.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _session_processes(serve.pid) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(serve.pid, signal.SIGKILL)
        out.close()


def _session_processes(sid: int) -> list[str]:
    """The processes of session ``sid`` still running (zombies aside)."""
    listing = subprocess.run(
        ["ps", "-e", "-o", "sid=,stat=,args="], capture_output=True, text=True, check=True
    ).stdout
    return [
        line
        for line in listing.splitlines()
        if line.split()[0] == str(sid) and not line.split()[1].startswith("Z")
    ]


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_a_ray_address_where_nothing_listens_is_one_message_at_once(scheme: str, capsys) -> None:
    """ray.address naming a port nothing listens on: exit 2 and one line naming ray.address, at
    once (ray.init retried for minutes and did not hear Ctrl-C)."""
    import ray

    from cluster.cli import main
    from cluster.serve import listening_socket

    closed = listening_socket("127.0.0.1", 0)
    port = closed.getsockname()[1]
    closed.close()  # (a port just freed: nothing listens there)
    code = main(["serve", str(REPO / "configs" / "local.yaml"), "--port", "0", "--set",
                 f"ray.address={scheme}127.0.0.1:{port}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and not ray.is_initialized(), err
    assert (
        f"ray.address: cannot connect to Ray: nothing accepts connections at {scheme}127.0.0.1:{port}"
        in err
    )
    assert "Traceback" not in err, err
