#!/usr/bin/env bash
# GPU work of one device call: `. .gpu/setup.sh` first (see README of the GPU machines), then this.
# Works on one GPU or more: steps that need two GPUs say so and are skipped on one. Results go under
# $OUT (or ./out). STEPS picks what runs (default: tests transfer cluster bench):
#   tests     GPU tests of kernels/ and transfer/ (cuda_ipc between two processes: on two GPUs when
#             there are two, else both on GPU 0)
#   transfer  scripts/bench_transfer.py --device cuda, 1 MiB .. 1 GiB: the ucx and cuda_ipc paths
#             next to raw ucxx and a torch peer copy of the same bytes, in the same run
#   cpu       scripts/bench_transfer.py on the CPU (ucx and host_shm) on this host's cores
#   cluster   scripts/gpu_cluster_check.py: 1P1D vs aggregated tokens, transfer path and figures (2 GPUs)
#   bench     duet bench of configs/gpu_1p1d.yaml against its aggregated twin (2 GPUs)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0   # keep Ray on loopback
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
echo "$GPUS GPU(s)"
for step in ${STEPS:-tests transfer cluster bench}; do
  echo "== $step"
  case $step in
    tests)
      python -m pytest -q -m gpu tests/kernels tests/transfer ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -15 ;;
    transfer)
      python scripts/bench_transfer.py --device cuda --repeats 9 \
        --out "$OUT/transfer_gpu.json" 2>&1 | tee "$OUT/transfer_gpu.log" | grep MiB ;;
    cpu)
      echo "$(nproc) cores" | tee "$OUT/transfer_cpu.log"
      python scripts/bench_transfer.py --device cpu --repeats 9 \
        --out "$OUT/transfer_cpu.json" 2>&1 | tee -a "$OUT/transfer_cpu.log" | grep MiB ;;
    cluster|bench)
      if [ "$GPUS" -lt 2 ]; then
        echo "skipped: configs/gpu_1p1d.yaml puts prefill and decode on two GPUs, this machine has $GPUS"
        continue
      fi
      if [ $step = cluster ]; then
        python scripts/gpu_cluster_check.py 2>&1 | tee "$OUT/gpu_cluster.log" | grep -v "^\s*$" | tail -60
      else
        python -m cluster.bench configs/gpu_1p1d.yaml --compare aggregated --tokenizer none \
          --vocab-size 128000 --num-prompts 32 --input-len 2048 --output-len 64 --request-rate 2 8 inf \
          --disable-tqdm --no-plots --output-dir "$OUT/bench" 2>&1 | tee "$OUT/gpu_bench.log" | tail -60
      fi ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
