#!/usr/bin/env bash
# GPU work of one device call, on a 2-GPU machine: `. .gpu/setup.sh` first (see README of the GPU
# machines), then this. Results go under $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0   # keep Ray on loopback
[ -n "${SKIP_KERNEL_TESTS:-}" ] || python -m pytest -q -m gpu tests/kernels 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
python scripts/gpu_cluster_check.py 2>&1 | tee "$OUT/gpu_cluster.log" | grep -v "^\s*$" | tail -40
python -m cluster.bench configs/gpu_1p1d.yaml --compare aggregated --tokenizer none --vocab-size 128000 \
  --num-prompts 32 --input-len 2048 --output-len 64 --request-rate 2 8 inf --disable-tqdm --no-plots \
  --output-dir "$OUT/bench" 2>&1 | tee "$OUT/gpu_bench.log" | tail -60
