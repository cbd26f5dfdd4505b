"""The ``duet`` command line: serve, bench, config validate / schema, run-default.

Subcommands whose modules are heavy or written elsewhere (``cluster.serve``, ``cluster.bench.cli``,
``engine``) are imported only when that subcommand runs, so ``duet config ...`` stays fast and works
on a machine where those parts are missing.

Exit codes: 0 success, 1 a subcommand that is not available or failed, 2 bad usage or bad config.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

from cluster.config import ClusterConfig, ConfigError, load_config
from cluster.transfer_secret import secret_of

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="duet", description="Disaggregated prefill/decode LLM serving on Ray."
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level, of the HTTP server's lines too (default: INFO)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="start a cluster from a config and serve the API")
    serve.add_argument("config", help="cluster YAML file")
    _add_overrides(serve)
    serve.add_argument("--host", default=None, help="= --set server.host=HOST")
    serve.add_argument("--port", type=int, default=None, help="= --set server.port=PORT")

    # The bench driver owns its arguments: everything after `bench` goes to its own parser.
    commands.add_parser(
        "bench", add_help=False, help="benchmark a cluster (duet bench --help for its options)"
    )

    config = commands.add_parser("config", help="check cluster config files")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    validate = config_commands.add_parser("validate", help="validate config files")
    validate.add_argument("configs", nargs="+", metavar="CONFIG", help="cluster YAML file(s)")
    _add_overrides(validate)
    config_commands.add_parser("schema", help="print the JSON schema of the cluster config")

    run_default = commands.add_parser(
        "run-default", help="generate a few answers with the embedded model (what `make run` runs)"
    )
    run_default.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    run_default.add_argument(
        "--prompt", action="append", dest="prompts", help="a prompt (repeatable); default: two"
    )
    return parser


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="PATH=VALUE",
        help="set a config field without editing the file, e.g. --set decode.replicas=2 "
        "(repeatable; VALUE read as YAML; checked as the file is)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if args.command != "bench" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # One line per HTTP request would bury the bench report and the server's own messages.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    if args.command == "serve":
        shortcuts = [
            f"server.{k}={v}" for k in ("host", "port") if (v := getattr(args, k)) is not None
        ]
        return _serve(args.config, [*args.overrides, *shortcuts])
    if args.command == "bench":
        return _bench(extra)
    if args.command == "config":
        if args.config_command == "validate":
            return _validate(args.configs, args.overrides)
        return _schema()
    return _run_default(args.prompts or list(DEFAULT_PROMPTS), args.max_tokens)


def _serve(path: str, overrides: list[str]) -> int:
    config = _load_or_report(path, overrides)
    if config is None:
        return EXIT_USAGE
    serve_module = _import_optional("cluster.serve", "duet serve")
    if serve_module is None:
        return EXIT_FAILED
    result = serve_module.serve(config)
    return result if isinstance(result, int) else EXIT_OK


def _bench(bench_argv: list[str]) -> int:
    bench_cli = _import_optional("cluster.bench.cli", "duet bench")
    if bench_cli is None:
        return EXIT_FAILED
    parser = argparse.ArgumentParser(prog="duet bench", description="Benchmark a Duet cluster.")
    bench_cli.add_bench_arguments(parser)
    return int(bench_cli.run_bench(parser.parse_args(bench_argv)))


def _validate(paths: list[str], overrides: list[str]) -> int:
    status = EXIT_OK
    for path in paths:
        config = _load_or_report(path, overrides)
        if config is None:
            status = EXIT_USAGE
            continue
        if not config.aggregated:
            try:
                secret_of(config)  # (a weak DUET_TRANSFER_SECRET: `duet serve` refuses it)
            except ConfigError as e:
                print(e, file=sys.stderr)
                status = EXIT_USAGE
                continue
        mode = (
            "aggregated"
            if config.aggregated
            else f"disaggregated, {config.prefill.replicas} prefill"
        )
        print(
            f"OK {path} ({mode}, {config.decode.replicas} decode, model {config.model.model_name})"
        )
    return status


def _schema() -> int:
    print(json.dumps(ClusterConfig.model_json_schema(), indent=2))
    return EXIT_OK


def _run_default(prompts: list[str], max_tokens: int) -> int:
    engine = _import_optional("engine", "duet run-default")
    if engine is None:
        return EXIT_FAILED
    llm = engine.LLM(model="default")
    # Greedy, so `make run` prints the same answers every time; one batch for all prompts.
    params = engine.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
    for prompt, output in zip(
        prompts, llm.chat(conversations, params, use_tqdm=False), strict=True
    ):
        print(f"> {prompt}\n{output.text.strip()}\n", flush=True)
    return EXIT_OK


def _load_or_report(path: str, overrides: Sequence[str] = ()) -> ClusterConfig | None:
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return None


def _import_optional(module: str, command: str) -> ModuleType | None:
    """Import a subcommand's module; report (not raise) when that module itself is missing.

    A missing dependency *inside* the module still raises: that is a bug to see, not to hide.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
            raise
        print(f"{command} is not available: module {module} is missing", file=sys.stderr)
        return None


if __name__ == "__main__":
    sys.exit(main())
