"""`duet serve`: connect to (or start) Ray, build the cluster, and run the HTTP server.

``start_cluster`` is the same in the background (a server thread), for tests and `duet bench`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import ray
import uvicorn
from fastapi import FastAPI

from cluster.builder import BuildStopped, ClusterBuildError, ClusterHandles, build_cluster
from cluster.config import ClusterConfig, ConfigError, ServerConfig
from cluster.frontend import ClusterFrontend
from cluster.preflight import model_of
from cluster.server import create_app
from cluster.transfer_secret import secret_of
from engine.loaders import load_tokenizer
from engine.loaders.generation_defaults import GenerationDefaults, load_generation_defaults

log = logging.getLogger(__name__)
SOURCE = "model.generation_config (the checkpoint's generation_config.json)"


def connect_ray(config: ClusterConfig) -> bool:
    """Connect to the configured Ray cluster, the one of the enclosing job (RAY_ADDRESS, set by
    `ray job submit`), or start a local one bound to 127.0.0.1. True when this call started Ray.
    In a process where Ray already runs (a script that started it), that Ray is used as it is:
    the ``ray`` fields the config sets are named in a warning, since none of them applies."""
    if ray.is_initialized():
        unused = sorted(config.ray.model_fields_set)
        if unused:
            log.warning(
                "Ray is already running in this process: %s of the config do not apply (the "
                "running Ray's address, namespace and runtime_env do)",
                ", ".join(f"ray.{name}" for name in unused),
            )
        return False
    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {"namespace": config.ray.namespace, "log_to_driver": True}
    if config.ray.runtime_env:
        kwargs["runtime_env"] = dict(config.ray.runtime_env)
    if address:
        check_reachable(address)
        ray.init(address=address, **kwargs)
        return False
    _keep_local_ray_on_loopback()
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, **kwargs)
    return True


RAY_REACH_TIMEOUT_S = 5.0


def check_reachable(address: str) -> None:
    """ConnectionError unless something accepts a connection at a Ray ``address`` that names a
    host and port (``host:port``, ``ray://host:port``; "auto" and "local" are Ray's to find):
    with nothing there, ray.init retried for minutes, Ctrl-C unheard."""
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), RAY_REACH_TIMEOUT_S).close()
    except OSError as e:
        raise ConnectionError(
            f"nothing accepts connections at {address} ({e}); is a Ray head running there "
            "(`ray start --head`)?"
        ) from e


def _keep_local_ray_on_loopback() -> None:
    """Ray 2.60 turns a node address of 127.0.0.1 into the host's external IP (its
    resolve_ip_for_localhost) unless it believes it runs without a cluster network, which it reads
    from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when ray is imported. A Ray this process starts
    serves only this host, so the processes it starts get the variable, and this process (whose
    ray is imported already) the constant it became; a driver joining a cluster keeps both."""
    import ray._private.ray_constants as ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def make_frontend(
    config: ClusterConfig, handles: ClusterHandles, defaults: GenerationDefaults
) -> ClusterFrontend:
    """The serving backend over ``handles``; ``defaults``: ``sampling_defaults(config)``, read
    before the cluster was built."""
    tokenizer = load_tokenizer(
        config.model.source,
        config.model.load_format,
        has_dummy_config=config.model.dummy_config is not None,
    )
    model = ray.get(handles.decode[0].handle.model_info.remote(), timeout=60)
    return ClusterFrontend(
        handles.router(),
        tokenizer,
        config.model.model_name,
        model,
        handles.collector,
        stats_interval_s=config.stats.interval_s,
        max_stats_len=config.stats.max_stats_len,
        perf_buffer_len=config.stats.perf_buffer_len,
        sampling_defaults=defaults,
    )


def sampling_defaults(config: ClusterConfig) -> GenerationDefaults:
    """What a request leaves out is sampled with (model.generation_config), said in the log.
    ConfigError for a generation_config.json that asks for what no request may."""
    if config.model.generation_config == "none":
        return GenerationDefaults()
    try:
        defaults = load_generation_defaults(config.model.source, config.model.load_format)
    except ValueError as e:
        raise ConfigError(SOURCE, [f"model.generation_config: auto reads {e}"]) from None
    log.info("sampling defaults from the model's generation_config.json: %s", defaults.describe())
    return defaults


@dataclass
class RunningCluster:
    """A cluster serving HTTP from a background thread of this process."""

    url: str
    handles: ClusterHandles
    frontend: ClusterFrontend
    _server: uvicorn.Server
    _thread: threading.Thread
    _owns_ray: bool

    def stop(self) -> None:
        """Stop serving, then the workers, then Ray where this process started it. A server thread
        that will not end still has the workers stopped (a later cluster in this process would
        find them holding the CPUs); only Ray stays up then (see stop_server_thread), and the
        RuntimeError is raised after."""
        try:
            stop_server_thread(self._server, self._thread)
        finally:
            self.handles.shutdown()
        if self._owns_ray:
            ray.shutdown()


STOP_GRACE_S = 30.0
START_TIMEOUT_S = 30.0


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: any free port) and listening, for uvicorn to
    serve on, with the options uvicorn's own binding sets (address reuse, inheritable). Listening
    at once holds the port: with address reuse, a socket bound but not listening lets another
    process bind the same port (during the minutes the models load)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)  # (uvicorn's backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def start_server_thread(
    app: Any, host: str, port: int
) -> tuple[uvicorn.Server, threading.Thread, int]:
    """Serve ``app`` (an ASGI app, lifespan on) from a daemon thread; return once it listens, with
    the port it bound (``port`` 0: any free one). RuntimeError if it does not start in time."""
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="duet-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.05)
    return server, thread, server.servers[0].sockets[0].getsockname()[1]


def stop_server_thread(
    server: uvicorn.Server, thread: threading.Thread, grace_s: float = STOP_GRACE_S
) -> None:
    """End the HTTP server of ``thread``: ``grace_s`` for open requests to finish (the lifespan
    then stops the frontend's background tasks), then forced out (open streams cut, its event
    loop's tasks cancelled as the thread returns). Nothing of the server may outlive this call:
    Ray is shut down after it, and a Ray call from a leftover task (the collector drain) would
    start a new local Ray inside this process (Ray's auto-init). RuntimeError if it still runs."""
    server.should_exit = True
    thread.join(grace_s)
    if thread.is_alive():
        log.warning("the HTTP server did not stop within %.0f s; forcing it out", grace_s)
        server.force_exit = True
        thread.join(grace_s)
    if thread.is_alive():
        raise RuntimeError(
            f"the HTTP server thread did not end within {2 * grace_s:.0f} s; it is at:\n"
            + thread_stack(thread)
        )


def thread_stack(thread: threading.Thread) -> str:
    """Where ``thread`` runs now (for an error that says why it did not end)."""
    frame = sys._current_frames().get(thread.ident or -1)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(it has ended)"


def start_cluster(
    config: ClusterConfig, port: int | None = None, worker_log_level: str | None = None
) -> RunningCluster:
    """Build the cluster of ``config`` and serve it on 127.0.0.1-or-configured host in a thread.
    ``worker_log_level``: the workers' logging level (default: this process's)."""
    defaults = sampling_defaults(config)  # (a bad file is refused before anything starts)
    owns_ray = connect_ray(config)
    try:
        handles = build_cluster(config, worker_log_level=worker_log_level, fixed_nodes=owns_ray)
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise
    try:
        frontend = make_frontend(config, handles, defaults)
        app = app_of(config, frontend)
        host = config.server.host
        server, thread, bound_port = start_server_thread(
            app, host, config.server.port if port is None else port
        )
        return RunningCluster(
            f"http://{host}:{bound_port}", handles, frontend, server, thread, owns_ray
        )
    except BaseException:
        handles.shutdown()
        if owns_ray:
            ray.shutdown()
        raise


class _CutAtShutdown(logging.Filter):
    """Drops uvicorn's traceback of each request it cancels when ``server.shutdown_grace_s`` ends
    (its own line "Cancel N running task(s), timeout graceful shutdown exceeded" says so): about
    50 lines per open stream, as if each were a failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (
            isinstance(exc, asyncio.CancelledError)
            and record.getMessage().startswith("Exception in ASGI application")
        )


_CUT_AT_SHUTDOWN = _CutAtShutdown()


def serving_config(app: Any, server: ServerConfig) -> uvicorn.Config:
    """uvicorn's settings for `duet serve`: its loggers (one line per request on
    ``uvicorn.access``) at the level ``duet --log-level`` gave the root logger, not at uvicorn's
    own INFO; open requests cut ``server.shutdown_grace_s`` after a SIGTERM (uvicorn waits for
    them without end by default, and a stream may run for request_timeout_s)."""
    logging.getLogger("uvicorn.error").addFilter(_CUT_AT_SHUTDOWN)  # (once: the same filter)
    return uvicorn.Config(
        app,
        log_level=logging.getLogger().getEffectiveLevel(),
        timeout_graceful_shutdown=server.shutdown_grace_s,
    )


def app_of(config: ClusterConfig, frontend: ClusterFrontend) -> FastAPI:
    """The HTTP app over ``frontend`` with the ``server`` section's settings (its API key and
    body limit)."""
    api_key = config.server.api_key.get_secret_value() if config.server.api_key else None
    max_body = int(config.server.max_request_body_mb * (1 << 20))
    return create_app(frontend, api_key, max_body)


class _StopSignal:
    """`duet serve`'s SIGINT and SIGTERM handler: notes the signal, which the start-up checks
    between its steps and while the workers start. (Raising from the handler instead broke out
    of Ray's calls as a SystemError; Ray's own SIGTERM handler aborts the process, its workers'
    and agents' processes left running.)"""

    def __init__(self) -> None:
        self.name = ""

    def __call__(self, signum: int, _frame: object) -> None:
        self.name = signal.Signals(signum).name

    def requested(self) -> bool:
        return bool(self.name)

    def check(self) -> None:
        if self.name:
            raise BuildStopped(self.name)


def serve(config: ClusterConfig) -> int:
    """Run until interrupted (what `duet serve CONFIG` does): 0 once stopped (SIGINT or SIGTERM,
    while the workers start too: everything started is stopped), 2 for a setting to fix (the
    config, the model's source, the transfer secret, a port taken: before anything starts;
    resources no Ray node can give, Ray's address), 1 when a worker did not start. The error is
    printed in one message, not as a traceback."""
    try:
        model = model_of(config)  # (a model source that is none is refused before anything starts)
        defaults = sampling_defaults(config)
        # A fresh transfer secret unless the config or DUET_TRANSFER_SECRET gives one: the
        # workers' transceivers authenticate each other with it (transfer/handshake.py).
        secret = None if config.aggregated else secret_of(config)
        # Bound first: a port taken is found before any model loads, and the address printed
        # is the one served (port 0: the port taken).
        sock = server_socket(config)
    except ConfigError as e:
        print(f"duet serve: {e}", file=sys.stderr)
        return 2
    handles = None
    owns_ray = False
    # (uvicorn takes both signals while it serves, and raises them again once it has stopped.)
    stop = _StopSignal()
    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        owns_ray = connect_ray(config)
        for sig in handlers:  # (after Ray's start, which installs its own)
            signal.signal(sig, stop)
        stop.check()
        handles = build_cluster(
            config,
            transfer_secret=secret,
            model=model,
            fixed_nodes=owns_ray,
            should_stop=stop.requested,
        )
        frontend = make_frontend(config, handles, defaults)
        app = app_of(config, frontend)
        stop.check()
        print(
            f"Duet serving {frontend.model_name} on http://{config.server.host}:"
            f"{sock.getsockname()[1]}",
            flush=True,
        )
        uvicorn.Server(serving_config(app, config.server)).run(sockets=[sock])
        stop.check()
    except BuildStopped:
        print(f"duet serve: stopped ({stop.name})", file=sys.stderr)
    except ConnectionError as e:  # (Ray's: no cluster at ray.address / RAY_ADDRESS)
        print(f"duet serve: ray.address: cannot connect to Ray: {e}", file=sys.stderr)
        return 2
    except (ConfigError, ClusterBuildError) as e:
        print(f"duet serve: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    finally:
        try:
            sock.close()  # (uvicorn closed it already when it served)
            if handles is not None:
                handles.shutdown()
            if owns_ray:
                ray.shutdown()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    return 0


def server_socket(config: ClusterConfig) -> socket.socket:
    """The HTTP server's listening socket, or a ConfigError naming ``server.host`` /
    ``server.port`` when it cannot be bound here."""
    host, port = config.server.host, config.server.port
    try:
        return listening_socket(host, port)
    except OSError as e:
        raise ConfigError(
            "(server section)",
            [f"server.port / server.host: cannot listen on {host}:{port}: {e.strerror}"],
        ) from None
