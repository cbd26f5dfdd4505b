"""From parsed `duet bench` arguments to the workload and the sweep options (validated up front,
so a bad SLO, percentile or workload file fails before any request is sent)."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from cluster.bench.client import DRIVER_FIELDS
from cluster.bench.datasets import WorkloadError, load_jsonl, load_sharegpt
from cluster.bench.metrics import parse_percentiles
from cluster.bench.records import BenchRequest
from cluster.bench.runner import ArrivalSettings
from cluster.bench.slo import parse_slos
from cluster.bench.sweep import SweepOptions
from cluster.bench.tokens import HFTokenizerCodec, load_embedded_codec
from cluster.bench.workloads import multi_turn_workload, random_workload, shared_prefix_workload

WORKLOADS = ("random", "shared-prefix", "multi-turn", "jsonl", "sharegpt")
SYNTHETIC = ("random", "shared-prefix", "multi-turn")
DEFAULT_TARGET = "configs/local.yaml"
DEFAULT_OUTPUT_LEN = 16
# --endpoint's values: ours, and the paths `vllm bench serve --endpoint` takes.
_ENDPOINTS = {
    "completions": "completions",
    "/v1/completions": "completions",
    "chat": "chat",
    "/v1/chat/completions": "chat",
}


# `vllm bench serve --backend` values of OpenAI-compatible servers, and the API each calls.
_BACKENDS = {
    "vllm": "completions",
    "openai": "completions",
    "sglang": "completions",
    "openai-chat": "chat",
    "vllm-chat": "chat",
}


def _api_of(table: dict[str, str], text: str, refusal: str) -> str:
    try:
        return table[text]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{refusal}: expected one of {', '.join(table)}") from None


def parse_endpoint(text: str) -> str:
    """--endpoint for argparse: "completions" or "chat", or vLLM's path of either."""
    return _api_of(_ENDPOINTS, text, f"bad endpoint {text!r}")


def parse_backend(text: str) -> str:
    """--backend for argparse (vLLM's flag): the endpoint of an OpenAI-compatible backend."""
    return _api_of(
        _BACKENDS, text, f"backend {text!r} is not an OpenAI-compatible server's (or --endpoint)"
    )


def resolve_target(args: argparse.Namespace) -> str:
    """What to benchmark: TARGET (a config or a URL), or the server that --base-url, or --host and
    --port, name as `vllm bench serve` does; configs/local.yaml when none is given. Naming it
    both ways is refused: one of the two would be ignored."""
    by_flags = [f for f in ("base_url", "host", "port") if getattr(args, f) is not None]
    if not by_flags:
        return args.target if args.target is not None else DEFAULT_TARGET
    flags = " / ".join("--" + f.replace("_", "-") for f in by_flags)
    if args.target is not None:
        raise ValueError(f"the server is named twice: TARGET {args.target} and {flags}")
    if args.base_url is not None:
        if len(by_flags) > 1:
            raise ValueError("--base-url names the whole server: leave --host and --port out")
        return args.base_url
    host = args.host if args.host is not None else "127.0.0.1"
    port = args.port if args.port is not None else 8000
    if not 0 < port < 65536:
        raise ValueError(f"--port must be within 1..65535, got {port}")
    if ":" in host and not host.startswith("["):  # an IPv6 address, bracketed in a URL
        host = f"[{host}]"
    return f"http://{host}:{port}"


# `vllm bench serve`'s sampling flags: each sent as its body field, only when given.
SAMPLING_FLAGS: dict[str, type] = {
    "--top-p": float,
    "--top-k": int,
    "--min-p": float,
    "--frequency-penalty": float,
    "--presence-penalty": float,
    "--repetition-penalty": float,
}


def parse_json_object(text: str) -> dict[str, Any]:
    """--extra-body for argparse: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _headers(items: list[str] | None) -> dict[str, str]:
    headers = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--header {item!r}: expected KEY=VALUE")
        headers[key.strip()] = value.strip()
    return headers


def _extra_body(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags given, then --extra-body (which wins, as in `vllm bench serve`)."""
    body = {
        flag[2:].replace("-", "_"): value
        for flag in SAMPLING_FLAGS
        if (value := getattr(args, flag[2:].replace("-", "_"))) is not None
    }
    body.update(args.extra_body or {})
    owned = sorted(set(body) & set(DRIVER_FIELDS))
    if owned:
        raise ValueError(f"--extra-body may not set {', '.join(owned)}: the driver does")
    return body


def parse_rate(text: str) -> float:
    """A request rate for argparse: a positive number of requests/s, or "inf"."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad request rate {text!r}: expected a number or inf"
        ) from None
    if not rate > 0.0:
        raise argparse.ArgumentTypeError(f"bad request rate {text!r}: must be > 0 (or inf)")
    return rate


def build_sweep_options(args: argparse.Namespace) -> SweepOptions:
    """Sweep options from the arguments; raises SloSpecError or ValueError on bad values."""
    slos = parse_slos(args.goodput) if args.goodput is not None else None
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.run_deadline is not None and not args.run_deadline > 0.0:
        raise ValueError(f"--run-deadline must be > 0 seconds, got {args.run_deadline}")
    if not args.ready_check_timeout_sec >= 0.0:
        raise ValueError("--ready-check-timeout-sec must be >= 0")
    if not args.request_timeout > 0.0:
        raise ValueError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if not (args.burstiness > 0.0 and args.ramp_up_seconds >= 0.0):
        raise ValueError("--burstiness must be > 0 and --ramp-up-seconds >= 0")
    if args.ramp_up_seconds > 0.0 and math.inf in args.request_rate:
        raise ValueError(
            "--ramp-up-seconds spreads the first sends of a finite --request-rate; at rate inf "
            "every request is sent at once (give finite rates)"
        )
    arrivals = ArrivalSettings(
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        ramp_up_s=args.ramp_up_seconds,
        seed=args.seed,
    )
    return SweepOptions(
        request_rates=tuple(sorted(args.request_rate)),
        arrivals=arrivals,
        percentiles=parse_percentiles(args.percentiles),
        slos=slos,
        model=args.model,
        endpoint=args.endpoint,
        request_timeout_s=args.request_timeout,
        run_deadline_s=args.run_deadline,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        num_warmups=args.num_warmups,
        server_metrics_wait_s=args.server_metrics_wait,
        show_progress=not args.disable_tqdm,
        ready_timeout_s=args.ready_check_timeout_sec,
        api_key=args.api_key,
        env_api_key=os.environ.get("OPENAI_API_KEY") or None,
        headers=_headers(args.header),
        extra_body=_extra_body(args),
        reset_prefix_cache=args.reset_prefix_cache,
    )


def _codec(args: argparse.Namespace) -> HFTokenizerCodec | None:
    """The tokenizer --tokenizer names: "embedded" (the default model's), "none", or a tokenizer.json."""
    if args.tokenizer == "none":
        return None
    if args.vocab_size is not None:
        raise ValueError(
            "--vocab-size draws random ids without a tokenizer: use it with --tokenizer none"
        )
    if args.tokenizer == "embedded":
        return load_embedded_codec()
    try:
        return HFTokenizerCodec.from_file(args.tokenizer)
    except Exception as exc:  # `tokenizers` raises a bare Exception for a missing or bad file
        raise WorkloadError(f"cannot load the tokenizer {args.tokenizer}: {exc}") from None


def _vocab(args: argparse.Namespace, codec: HFTokenizerCodec | None) -> list[int]:
    """The ids random prompts draw from: the tokenizer's normal tokens, or 0..N-1 without one."""
    if codec is not None:
        return codec.normal_token_ids()
    if args.vocab_size is None or args.vocab_size < 1:
        raise ValueError("random prompts with --tokenizer none need --vocab-size N (N >= 1)")
    return list(range(args.vocab_size))


# Flags that shape one kind of workload: (the workloads that read it, its default there).
_WORKLOAD_FLAGS: dict[str, tuple[tuple[str, ...], Any]] = {
    "dataset_path": (("jsonl", "sharegpt"), None),
    "sharegpt_output_len": (("sharegpt",), None),
    "prefix_len": (("shared-prefix",), 32),
    "num_prefix_groups": (("shared-prefix",), 4),
    "num_turns": (("multi-turn",), 2),
    "turn_len": (("multi-turn",), 32),
    "random_prefix_len": (("random",), 0),
    "input_len": (SYNTHETIC, 64),
    "range_ratio": (SYNTHETIC, 0.0),
    "vocab_size": (SYNTHETIC, None),  # (a file's prompts are its own)
}


def check_workload_flags(args: argparse.Namespace) -> None:
    """A flag given for another workload than ``--workload`` is refused (it would change
    nothing: --dataset-path with random prompts ran random prompts); those of the chosen one
    get their defaults."""
    for name, (workloads, default) in _WORKLOAD_FLAGS.items():
        if getattr(args, name) is None:
            if args.workload in workloads:
                setattr(args, name, default)
        elif args.workload not in workloads:
            flag = "--" + name.replace("_", "-")
            raise WorkloadError(
                f"{flag} is read by --workload {' / '.join(workloads)}, not by "
                f"--workload {args.workload}"
            )


def output_len(args: argparse.Namespace) -> int:
    """max_tokens of the requests whose workload does not say it: --output-len or its default."""
    return args.output_len if args.output_len is not None else DEFAULT_OUTPUT_LEN


def sharegpt_fixed_output_len(args: argparse.Namespace) -> int | None:
    """The output length of every ShareGPT request, when one is given: --sharegpt-output-len, or
    --output-len as `vllm bench serve` takes it there (not only the fallback for a reply whose
    length no tokenizer counts); None lets each reply's length decide."""
    given = {v for v in (args.output_len, args.sharegpt_output_len) if v is not None}
    if len(given) > 1:
        raise WorkloadError(
            f"--output-len {args.output_len} and --sharegpt-output-len "
            f"{args.sharegpt_output_len} disagree: give one"
        )
    return given.pop() if given else None


def build_workload(args: argparse.Namespace, part: int = 0) -> list[BenchRequest]:
    """The requests of a run (part 0: of every run, the same list for every rate and target).
    With ``--fresh-prompts-per-rate`` the i-th rate takes part i: synthetic prompts drawn with
    seed + i, a file's next ``--num-prompts`` prompts (none shared with another part)."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    check_workload_flags(args)
    codec = _codec(args)
    if args.workload in ("jsonl", "sharegpt"):
        if not args.dataset_path:
            raise WorkloadError(f"the {args.workload} workload needs --dataset-path")
        skip = part * args.num_prompts
        if args.workload == "jsonl":
            requests = load_jsonl(
                args.dataset_path, args.num_prompts, output_len(args), codec, skip=skip
            )
        else:
            requests = load_sharegpt(
                args.dataset_path,
                args.num_prompts,
                DEFAULT_OUTPUT_LEN,
                codec,
                sharegpt_fixed_output_len(args),
                args.seed,
                skip=skip,
            )
        if len(requests) < args.num_prompts:
            # Fewer requests than asked would be a smaller run than the report says was asked for.
            usable = "usable prompts" if args.workload == "sharegpt" else "prompts"
            if part:
                raise WorkloadError(
                    f"--fresh-prompts-per-rate: {args.dataset_path} has too few {usable} for "
                    f"rate {part + 1} (each rate takes {args.num_prompts} of its own: "
                    f"{part + 1} x --num-prompts at least)"
                )
            raise WorkloadError(
                f"{args.dataset_path} has {len(requests)} {usable}, fewer than --num-prompts "
                f"{args.num_prompts}: pass --num-prompts {len(requests)} (or fewer)"
            )
    else:
        if args.endpoint == "chat" and codec is None:
            raise WorkloadError(
                "random prompts for the chat endpoint must be text: they need a tokenizer"
            )
        text_codec = codec if args.endpoint == "chat" else None  # completions take exact token ids
        vocab = _vocab(args, codec)
        common = dict(
            output_len=output_len(args),
            vocab=vocab,
            range_ratio=args.range_ratio,
            seed=args.seed + part,
        )
        if args.workload == "random":
            requests = random_workload(
                args.num_prompts,
                args.input_len,
                codec=text_codec,
                prefix_len=args.random_prefix_len,
                **common,  # type: ignore[arg-type]
            )
        elif args.workload == "multi-turn":
            if args.num_turns < 1 or args.num_prompts % args.num_turns:
                raise ValueError(
                    f"--num-prompts ({args.num_prompts}) must be a multiple of --num-turns "
                    f"({args.num_turns}, >= 1): whole conversations"
                )
            requests = multi_turn_workload(
                args.num_prompts // args.num_turns,
                args.num_turns,
                args.input_len,
                args.turn_len,
                codec=text_codec,
                **common,  # type: ignore[arg-type]
            )
        else:
            requests = shared_prefix_workload(
                args.num_prompts,
                args.num_prefix_groups,
                args.prefix_len,
                args.input_len,
                codec=text_codec,
                **common,  # type: ignore[arg-type]
            )
    if args.endpoint == "chat" and any(not isinstance(r.prompt, str) for r in requests):
        raise WorkloadError(
            "the chat endpoint needs text prompts; this workload has token-id prompts"
        )
    return requests


def describe_workload(args: argparse.Namespace, requests: list[BenchRequest]) -> dict[str, Any]:
    """The workload part of the results header."""
    known = [r.prompt_len for r in requests if r.prompt_len is not None]
    return {
        "name": args.workload,
        "dataset_path": args.dataset_path,
        "num_prompts": len(requests),
        "input_len": args.input_len if args.workload in SYNTHETIC else None,
        "output_len": (
            sharegpt_fixed_output_len(args) if args.workload == "sharegpt" else output_len(args)
        ),
        "range_ratio": args.range_ratio if args.workload in SYNTHETIC else None,
        "prefix_len": {"shared-prefix": args.prefix_len, "random": args.random_prefix_len}.get(
            args.workload
        ),
        "num_prefix_groups": args.num_prefix_groups if args.workload == "shared-prefix" else None,
        "num_turns": args.num_turns if args.workload == "multi-turn" else None,
        "turn_len": args.turn_len if args.workload == "multi-turn" else None,
        "mean_prompt_len": sum(known) / len(known) if known else None,
        "mean_max_tokens": sum(r.output_len for r in requests) / len(requests),
        "seed": args.seed,
        "tokenizer": args.tokenizer,
    }
