"""`duet bench`: its arguments and its entry point (called by cluster.cli, or `python -m cluster.bench`).

Exit codes: 0 when every target's sweep completed, 1 when the benchmark stopped on an error (a clear
message on stderr; the results gathered so far are still written to the JSON file), 2 for bad
command-line syntax (argparse's own).
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path
from typing import Any

from cluster.bench.datasets import WorkloadError
from cluster.bench.errors import BenchError
from cluster.bench.options import (
    DEFAULT_OUTPUT_LEN,
    DEFAULT_TARGET,
    SAMPLING_FLAGS,
    WORKLOADS,
    build_sweep_options,
    build_workload,
    describe_workload,
    parse_backend,
    parse_endpoint,
    parse_json_object,
    parse_rate,
    resolve_target,
)
from cluster.bench.report import comparison_rows, render_report
from cluster.bench.results_file import DEFAULT_OUTPUT_DIR, measured, save_results
from cluster.bench.slo import SloSpecError
from cluster.bench.sweep import run_sweeps
from cluster.bench.target import build_targets
from cluster.bench.vllm_result import VLLM_PERCENTILE_METRICS, VllmResultFiles


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every `duet bench` argument to ``parser`` (names follow `vllm bench serve` where they exist)."""
    parser.add_argument(
        "target",
        nargs="?",
        default=None,
        help="a cluster config YAML (started on local Ray and stopped after) or the URL of any "
        f"OpenAI-compatible server (default: {DEFAULT_TARGET})",
    )
    server = parser.add_argument_group(
        "a running server named as `vllm bench serve` names it (instead of TARGET)"
    )
    server.add_argument("--base-url", default=None, help="its root URL, e.g. http://10.0.0.5:8000")
    server.add_argument(
        "--host", default=None, help="with --port: http://HOST:PORT (default host 127.0.0.1)"
    )
    server.add_argument("--port", type=int, default=None, help="(default port 8000)")
    parser.add_argument(
        "--model", default=None, help="model name to send (default: the first at /v1/models)"
    )
    parser.add_argument(
        "--endpoint",
        type=parse_endpoint,
        default="completions",
        metavar="completions|chat",
        help="the API to call (vLLM's /v1/completions and /v1/chat/completions are taken too)",
    )
    parser.add_argument(
        "--backend",
        dest="endpoint",
        type=parse_backend,
        default=argparse.SUPPRESS,
        metavar="vllm|openai|sglang|openai-chat|vllm-chat",
        help="`vllm bench serve`'s name for the API: openai-chat and vllm-chat call chat, the "
        "others completions (the later of --backend and --endpoint wins)",
    )
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--workload",
        "--dataset-name",
        choices=WORKLOADS,
        default="random",
        help="what to send (random and sharegpt as `vllm bench serve --dataset-name` has them)",
    )
    work.add_argument("--dataset-path", default=None, help="the JSONL or ShareGPT JSON file")
    work.add_argument("--num-prompts", type=int, default=16, help="requests per run (per rate)")
    work.add_argument(
        "--input-len",
        "--random-input-len",
        type=int,
        default=None,
        help="random, shared-prefix, multi-turn: random prompt tokens (after the prefix; 64)",
    )
    work.add_argument(
        "--output-len",
        "--random-output-len",
        type=int,
        default=None,
        help=f"max_tokens per request (default {DEFAULT_OUTPUT_LEN}; jsonl: for lines without "
        "output_len; sharegpt: given, it fixes every request's, as --sharegpt-output-len)",
    )
    work.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        type=float,
        default=None,
        help="random, shared-prefix, multi-turn: lengths uniform in len*(1-r)..len*(1+r) (0)",
    )
    work.add_argument(
        "--random-prefix-len",
        type=int,
        default=None,
        help="random: one prefix of this many tokens shared by every prompt (before --input-len)",
    )
    work.add_argument(
        "--prefix-len",
        type=int,
        default=None,
        help="shared-prefix: tokens of each group's prefix (32)",
    )
    work.add_argument(
        "--num-prefix-groups", type=int, default=None, help="shared-prefix: number of prefixes (4)"
    )
    work.add_argument(
        "--num-turns",
        type=int,
        default=None,
        help="multi-turn: turns per conversation (--num-prompts / this = conversations; 2)",
    )
    work.add_argument(
        "--turn-len",
        type=int,
        default=None,
        help="multi-turn: new tokens of each later turn (after the previous prompt and answer; 32)",
    )
    work.add_argument(
        "--sharegpt-output-len", type=int, default=None, help="fixed output length for ShareGPT"
    )
    work.add_argument(
        "--tokenizer",
        default="embedded",
        metavar="embedded|none|TOKENIZER_JSON|CHECKPOINT_DIR",
        help="the target model's tokenizer: the embedded model's (default), none, a "
        "tokenizer.json file, or a checkpoint directory holding one",
    )
    work.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="with --tokenizer none: random prompts of token ids 0..N-1",
    )
    work.add_argument("--seed", type=int, default=0)
    work.add_argument(
        "--fresh-prompts-per-rate",
        action="store_true",
        help="another workload at every rate of a sweep (synthetic: drawn with seed + rate index; "
        "jsonl, sharegpt: the file's next --num-prompts prompts), so that no rate hits the prefix "
        "cache of an earlier one; every target sees the same prompts at a rate",
    )
    work.add_argument(
        "--reset-prefix-cache",
        action="store_true",
        help="before every run, POST /reset_prefix_cache?reset_external=true (SGLang's "
        "--flush-cache): each run starts with a cold prefix cache, host tier too (vLLM serves it "
        "only with VLLM_SERVER_DEV_MODE=1)",
    )
    load = parser.add_argument_group("arrivals")
    load.add_argument(
        "--request-rate",
        type=parse_rate,
        nargs="+",
        default=[math.inf],
        help="requests/s; several values sweep them in one command; inf sends all at once",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival gaps; 1 = Poisson",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument(
        "--ramp-up-seconds",
        type=float,
        default=0.0,
        help="rate grows linearly from 0 over this time",
    )
    out = parser.add_argument_group("metrics and output")
    out.add_argument(
        "--percentiles",
        "--metric-percentiles",
        default="50,90,99",
        help="comma-separated percentiles to report",
    )
    out.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs in ms, KEY in ttft, tpot, e2el, e.g. --goodput ttft:500 tpot:50",
    )
    out.add_argument(
        "--compare",
        choices=("aggregated",),
        default=None,
        help="also run the aggregated mode on the same resources, side by side",
    )
    out.add_argument(
        "--compare-target",
        default=None,
        metavar="URL_OR_CONFIG",
        help="the aggregated baseline: a URL, or a config (default for a config target: "
        "its sibling NAME_aggregated.yaml)",
    )
    out.add_argument(
        "--output-dir",
        default=None,
        help=f"where results.json and the plots go (default: {DEFAULT_OUTPUT_DIR}; the plots go "
        "beside --result-file when only it is given)",
    )
    out.add_argument(
        "--result-file", default=None, help="JSON results path (default: OUTPUT_DIR/results.json)"
    )
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    saved = parser.add_argument_group(
        "per-run files as `vllm bench serve --save-result` writes them (besides results.json)"
    )
    saved.add_argument(
        "--save-result",
        action="store_true",
        help="also write each run (target x rate) as vLLM's flat result JSON",
    )
    saved.add_argument(
        "--result-dir", default=None, help="where those files go (default: --output-dir)"
    )
    saved.add_argument(
        "--result-filename",
        default=None,
        help="the file's name, for a single run (default: "
        "LABEL-RATEqps[-concurrencyC]-MODEL-DATE.json, as vLLM names it)",
    )
    saved.add_argument(
        "--label", default=None, help="the files' label (default: the target's: disaggregated, ...)"
    )
    saved.add_argument(
        "--percentile-metrics",
        default=None,
        help="the metrics whose statistics those files hold, of ttft,tpot,itl,e2el (default "
        f"{','.join(VLLM_PERCENTILE_METRICS)}, as vLLM's; the report and results.json always "
        "hold all four)",
    )
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    send = parser.add_argument_group("requests")
    send.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds for one request"
    )
    send.add_argument(
        "--run-deadline",
        type=float,
        default=None,
        help="seconds for one run, the rest then fail (default: its last arrival plus "
        "--request-timeout for every request that must wait for another: never shorter than "
        "the requests' own timeouts allow)",
    )
    send.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=0.0,
        help="wait up to this long for a server that does not answer yet (default: fail at once)",
    )
    send.add_argument(
        "--num-warmups", type=int, default=1, help="unmeasured requests before each target's sweep"
    )
    send.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly max_tokens tokens (a vLLM extension; on by default, so that every "
        "run sends the same output lengths: --no-ignore-eos for vLLM bench's default or a "
        "strict server)",
    )
    send.add_argument("--temperature", type=float, default=0.0)
    for flag, kind in SAMPLING_FLAGS.items():
        send.add_argument(flag, type=kind, default=None, help="sent only when given")
    send.add_argument(
        "--extra-body",
        type=parse_json_object,
        default=None,
        metavar="JSON",
        help="a JSON object joined to every request's body (it wins over the sampling flags), "
        'e.g. \'{"chat_template_kwargs": {"enable_thinking": false}}\'',
    )
    send.add_argument(
        "--api-key",
        default=None,
        help="the server's bearer token (default: a config target's server.api_key, else "
        "OPENAI_API_KEY)",
    )
    send.add_argument(
        "--header",
        nargs="+",
        default=None,
        metavar="KEY=VALUE",
        help="more headers for every request (they win over --api-key's)",
    )
    send.add_argument(
        "--server-metrics-wait",
        type=float,
        default=5.0,
        help="seconds to wait after a run for Duet's /perf_metrics entries",
    )


def parse_bench_args(argv: list[str]) -> argparse.Namespace:
    """Parse `duet bench` arguments outside the main CLI (for `duet run-default` and tests)."""
    parser = argparse.ArgumentParser(
        prog="duet bench", description="Benchmark a Duet cluster or any OpenAI server."
    )
    add_bench_arguments(parser)
    return parser.parse_args(argv)


def _header(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-compatible",
        "endpoint_type": args.endpoint,
        "target": None,
        "num_prompts": args.num_prompts,
        "request_rates": sorted(args.request_rate),
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ramp_up_seconds": args.ramp_up_seconds,
        "fresh_prompts_per_rate": args.fresh_prompts_per_rate,
        "reset_prefix_cache": args.reset_prefix_cache,  # every run started with a cold cache
        "extra_body": None,
        "percentiles": [],
        "goodput_slos": None,
        "workload": None,
        "targets": [],
        "comparison": [],
        "error": None,
    }


def run_bench(args: argparse.Namespace) -> int:
    """Run `duet bench` with parsed arguments; returns the exit code (see the module docstring)."""
    results = _header(args)
    out_dir = Path(args.output_dir or DEFAULT_OUTPUT_DIR)
    result_path = Path(args.result_file) if args.result_file else out_dir / "results.json"
    plot_dir = out_dir if args.output_dir or not args.result_file else result_path.parent
    vllm_files: VllmResultFiles | None = None
    saved_paths: list[Path] = []
    try:
        try:
            target = resolve_target(args)
            results["target"] = target
            options = build_sweep_options(args)
            vllm_files = VllmResultFiles.from_args(args)
            targets = build_targets(target, args.compare, args.compare_target)
            if vllm_files is not None:
                vllm_files.check_single_run(len(targets) * len(options.request_rates))
            requests = build_workload(args)
            per_rate = None
            if args.fresh_prompts_per_rate:
                per_rate = [build_workload(args, i) for i in range(len(args.request_rate))]
        except (SloSpecError, WorkloadError) as exc:
            raise BenchError(str(exc)) from None
        except (ValueError, OSError) as exc:
            raise BenchError(f"bad benchmark settings: {exc}") from None
        results["extra_body"] = dict(options.extra_body) or None
        results["percentiles"] = list(options.percentiles)
        results["goodput_slos"] = options.slos.as_dict() if options.slos else None
        results["workload"] = describe_workload(args, requests)
        run_sweeps(targets, requests, options, results, per_rate)
    except BenchError as exc:
        results["error"] = str(exc)
    except KeyboardInterrupt:
        results["error"] = "interrupted"
    finally:
        # Saved on every path, a crash included, so that nothing measured is lost (and a run
        # that measured nothing says why there, unless an earlier run's results are there).
        results["comparison"] = comparison_rows(results) if results["percentiles"] else []
        written = save_results(result_path, results)
        if vllm_files is not None:  # (each complete run, also when a later one failed)
            saved_paths = vllm_files.write(results)
    print(render_report(results), end="")
    if not args.no_plots and measured(results):
        from cluster.bench.plots import write_plots

        plots = write_plots(results, plot_dir)
        print("plots: " + ", ".join(str(p) for p in plots))
    print(f"results: {result_path}" if written else f"results: {result_path} left as it was")
    if vllm_files is not None:
        print("vLLM-layout results: " + (", ".join(str(p) for p in saved_paths) or "none"))
    if results["error"]:
        kept = (
            f"results so far saved to {result_path}"
            if written
            else f"nothing measured: {result_path} keeps an earlier run's results"
        )
        print(f"duet bench: error: {results['error']} ({kept})", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_bench(parse_bench_args(sys.argv[1:] if argv is None else argv))
