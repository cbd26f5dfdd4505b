"""GPU check of the duet_kernels package: the gpu-marked tests, then the benchmark, results to a folder.

  python scripts/gpu_kernels.py --out-dir OUT [--sweep]

Writes OUT/gpu_tests.xml (junit, with each test's recorded max abs error), OUT/gpu_errors.json
(those errors by test) and OUT/bench_kernels.json; exits non-zero when a test or the bench fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def recorded_errors(junit_xml: Path) -> dict[str, float]:
    errors = {}
    for prop in ET.parse(junit_xml).iter("property"):
        if prop.get("name", "").endswith("max_abs_error"):
            errors[prop.get("name")] = float(prop.get("value"))
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--sweep", action="store_true")
    opts = parser.parse_args()
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    junit = opts.out_dir / "gpu_tests.xml"
    tests = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "gpu",
            "tests/duet_kernels",
            f"--junitxml={junit}",
            "-p",
            "no:cacheprovider",
            "-o",
            "junit_family=legacy",
        ],
        cwd=REPO_ROOT,
    )
    if junit.exists():
        errs = recorded_errors(junit)
        (opts.out_dir / "gpu_errors.json").write_text(json.dumps(errs, indent=2))
        for name, err in sorted(errs.items()):
            print(f"{name:60s} {err:.3e}")
    bench_cmd = [
        sys.executable,
        "scripts/bench_kernels.py",
        "--out",
        str(opts.out_dir / "bench_kernels.json"),
    ]
    bench = subprocess.run(bench_cmd + (["--sweep"] if opts.sweep else []), cwd=REPO_ROOT)
    return tests.returncode or bench.returncode


if __name__ == "__main__":
    raise SystemExit(main())
