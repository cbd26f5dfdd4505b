"""`--save-result`: each run also written as the flat JSON file `vllm bench serve --save-result`
writes, so that scripts made for vLLM's files read Duet's runs unchanged.

`duet bench` sweeps rates and targets in one command and keeps them all in one results.json; vLLM
writes one file per run. Here every run (target x rate) gets its own file, named as vLLM names it
(``LABEL-RATEqps[-concurrencyC]-MODEL-DATE.json``), with vLLM's top-level keys: the run's settings
(``date``, ``backend``, ``label``, ``model_id``, ``tokenizer_id``, ``num_prompts``,
``request_rate``, ``burstiness``, ``max_concurrency``), its totals and throughputs, the
per-request lists, and ``mean_/median_/std_/pNN_{metric}_ms`` of the metrics in
``--percentile-metrics`` only, as vLLM selects them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.bench.metrics import percentile_label
from cluster.bench.results_file import DEFAULT_OUTPUT_DIR, write_results

# The metrics vLLM keeps statistics of by default, and those it can be asked for here.
VLLM_PERCENTILE_METRICS = ("ttft", "tpot", "itl")
_METRICS = ("ttft", "tpot", "itl", "e2el")
# A run's fields copied as they are (same names and meaning in both tools).
_RUN_FIELDS = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
)
# The flags of these files (all None unless given).
_FLAGS = ("result_dir", "result_filename", "label", "percentile_metrics")
# The roles of a comparison's two targets, kept in the file name so that they do not collide.
_ROLES = ("disaggregated", "aggregated")


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    """ "ttft,tpot,itl" -> ("ttft", "tpot", "itl"); ValueError naming an unknown metric."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [n for n in names if n not in _METRICS]
    if unknown or not names:
        raise ValueError(f"--percentile-metrics {text!r}: expected some of {','.join(_METRICS)}")
    return names


@dataclass(frozen=True)
class VllmResultFiles:
    """Where and how the per-run files of one `duet bench` command are written."""

    result_dir: Path
    result_filename: str | None
    label: str | None
    backend: str  # vLLM's name for the API: "openai" (completions) or "openai-chat"
    tokenizer_id: str
    percentile_metrics: tuple[str, ...]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> VllmResultFiles | None:
        """From the parsed arguments: None without --save-result. Raises ValueError on a bad
        --percentile-metrics, or on a flag of these files given without --save-result (it
        would change nothing)."""
        if not args.save_result:
            given = [f for f in _FLAGS if getattr(args, f) is not None]
            if given:
                flags = ", ".join("--" + f.replace("_", "-") for f in given)
                raise ValueError(f"{flags}: read only with --save-result")
            return None
        metrics = args.percentile_metrics or ",".join(VLLM_PERCENTILE_METRICS)
        return cls(
            result_dir=Path(args.result_dir or args.output_dir or DEFAULT_OUTPUT_DIR),
            result_filename=args.result_filename,
            label=args.label,
            backend="openai-chat" if args.endpoint == "chat" else "openai",
            tokenizer_id=args.tokenizer,
            percentile_metrics=parse_percentile_metrics(metrics),
        )

    def check_single_run(self, runs: int) -> None:
        """--result-filename names one file: refused when the command makes several runs (each
        would overwrite the one before)."""
        if self.result_filename is not None and runs > 1:
            raise ValueError(
                f"--result-filename names one file, and this command makes {runs} runs "
                "(targets x rates): leave it out, and each run gets its own name"
            )

    def _label(self, target_label: str) -> str:
        role = target_label if target_label in _ROLES else None
        return "-".join(part for part in (self.label, role) if part) or self.backend

    def file_doc(
        self, header: dict[str, Any], entry: dict[str, Any], run: dict[str, Any]
    ) -> dict[str, Any]:
        """The flat document of one run of one target."""
        doc: dict[str, Any] = {
            "date": header["date"],
            "endpoint_type": self.backend,
            "backend": self.backend,
            "label": self._label(entry["label"]),
            "model_id": entry.get("model_id"),
            "tokenizer_id": self.tokenizer_id,
            "num_prompts": run["num_prompts"],
            "request_rate": run["request_rate"],
            "burstiness": run["burstiness"],
            "max_concurrency": run["max_concurrency"],
        }
        doc.update({key: run.get(key) for key in _RUN_FIELDS})
        # vLLM's per-request latencies: 0.0 where a request failed, as its client leaves them.
        doc["latencies"] = [e if e is not None else 0.0 for e in run["e2els"]]
        # A statistic over no values (TPOT when every request had one token) is 0.0, as vLLM
        # writes it (np.mean(x or 0)); Duet's own JSON says null.
        for metric in self.percentile_metrics:
            keys = [f"{stat}_{metric}_ms" for stat in ("mean", "median", "std")]
            keys += [f"p{percentile_label(p)}_{metric}_ms" for p in header["percentiles"]]
            for key in keys:
                doc[key] = run[key] if run[key] is not None else 0.0
        return doc

    def _path(self, doc: dict[str, Any]) -> Path:
        if self.result_filename is not None:
            return self.result_dir / self.result_filename
        concurrency = (
            f"-concurrency{doc['max_concurrency']}" if doc["max_concurrency"] is not None else ""
        )
        model = str(doc["model_id"] or "model").split("/")[-1]
        rate = float(doc["request_rate"])
        return self.result_dir / f"{doc['label']}-{rate}qps{concurrency}-{model}-{doc['date']}.json"

    def write(self, results: dict[str, Any]) -> list[Path]:
        """Write a file for every complete run in ``results`` (`duet bench`'s document, complete
        or not); returns their paths."""
        paths = []
        for entry in results["targets"]:
            for run in entry["runs"]:
                doc = self.file_doc(results, entry, run)
                paths.append(write_results(self._path(doc), doc))
        return paths
