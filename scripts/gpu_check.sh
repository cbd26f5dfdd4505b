#!/usr/bin/env bash
# GPU work of one device call: `. .gpu/setup.sh` first (see README of the GPU machines), then this.
# Works on one GPU or more: steps that need two GPUs say so and are skipped on one. Results go under
# $OUT (or ./out). STEPS picks what runs (default: tests decode warmup transfer shared cluster bench goodput tp):
#   tests     every GPU test (marker gpu): duet_kernels/, transfer/ (cuda_ipc between two processes: on
#             two GPUs when there are two, else both on GPU 0), engine/ (CUDA graphs, hybrid KV),
#             kvcache/ (the pinned host tier)
#   decode    scripts/bench_decode_gpu.py: the 8B shape's decode step at batch 1 / 16 / 64 and 1k
#             context against the memory floor from the copy bandwidth of the same run, and
#             offline throughput against HF generate on the same random model
#   warmup    scripts/bench_first_request.py: a fresh engine's first request with and without its
#             warm-up (the 8B shape, an empty Triton cache per process)
#   transfer  scripts/bench_transfer.py --device cuda, 1 MiB .. 1 GiB: the ucx and cuda_ipc paths
#             next to raw ucxx and a torch peer copy of the same bytes, in the same run
#   cpu       scripts/bench_transfer.py on the CPU (ucx and host_shm) on this host's cores
#   shared    configs/gpu_1p1d.yaml with both workers on one GPU (num_gpus 0.5 each), one request
#   cluster   scripts/gpu_cluster_check.py: 1P1D vs aggregated tokens, transfer path and figures (2 GPUs)
#   bench     duet bench of configs/gpu_1p1d.yaml against its aggregated twin (2 GPUs)
#   goodput   the ISL 4096 / OSL 256 rate sweep of configs/gpu_1p1d.yaml against its aggregated
#             twin, distinct prompts at every rate, goodput at TTFT <= 1 s and TPOT <= 50 ms (p90),
#             with plots (2 GPUs)
#   tp        configs/gpu_tp.yaml (prefill tp 2, decode tp 2) and a prefill tp 2 / decode tp 1
#             cluster against the tp 1 cluster's tokens, and tp 2 decode TPOT against tp 1 (4 GPUs)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0   # keep Ray on loopback
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
echo "$GPUS GPU(s)"
for step in ${STEPS:-tests decode warmup transfer shared cluster bench goodput tp}; do
  echo "== $step"
  case $step in
    tests)
      # the GPU machines have no gguf package: its loader tests (CPU only) cannot even import
      python -c "import gguf" 2>/dev/null || IGNORE="--ignore=tests/engine/test_loaders_gguf.py --ignore=tests/engine/test_loaders_gguf_written.py"
      python -m pytest -q -m gpu tests/duet_kernels tests/transfer tests/engine tests/kvcache ${IGNORE:-} \
        ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    decode)
      python scripts/bench_decode_gpu.py ${DECODE_ARGS:-} --out "$OUT/decode_gpu.json" 2>&1 \
        | tee "$OUT/decode_gpu.log" | grep -E "bandwidth|batch|offline" ;;
    warmup)
      python scripts/bench_first_request.py --device cuda --model llama-3-8b --load-format dummy \
        --dtype bfloat16 --out "$OUT/first_request_gpu.json" 2>&1 | tee "$OUT/first_request_gpu.log" ;;
    transfer)
      python scripts/bench_transfer.py --device cuda --repeats 9 \
        --out "$OUT/transfer_gpu.json" 2>&1 | tee "$OUT/transfer_gpu.log" | grep MiB ;;
    cpu)
      # CPU_CORES (e.g. 0,1) pins the run to a slice of this host, the size of the CI machine
      echo "$(nproc) cores, pinned to ${CPU_CORES:-all}" | tee "$OUT/transfer_cpu${CPU_TAG:-}.log"
      # Each path alone, as a worker of it progresses UCX (one mode per process). CPU_PATHS: which
      # (default both); CPU_ARGS: more arguments (e.g. --sizes 16 64 --progress-mode thread);
      # CPU_TAG names the run's files, so that one call can run several
      for path in ${CPU_PATHS:-ucx host_shm}; do
        ${CPU_CORES:+taskset -c $CPU_CORES} python scripts/bench_transfer.py --device cpu \
          --repeats 9 --paths $path ${CPU_ARGS:-} --out "$OUT/transfer_cpu_$path${CPU_TAG:-}.json" \
          2>&1 | tee -a "$OUT/transfer_cpu${CPU_TAG:-}.log" | grep -E "MiB|per page"
      done ;;
    tp)
      if [ "$GPUS" -lt 4 ]; then
        echo "skipped: configs/gpu_tp.yaml needs 4 GPUs, this machine has $GPUS"
        continue
      fi
      python scripts/gpu_tp_check.py 2>&1 | tee "$OUT/gpu_tp.log" | tail -40 ;;
    shared)
      # configs/gpu_1p1d.yaml on one GPU, both workers on it (resources.num_gpus 0.5: each takes
      # half of the GPU's memory times gpu_memory_fraction), one request through the cluster.
      python -m cluster.cli serve configs/gpu_1p1d.yaml --port 8011 \
        --set prefill.resources.num_gpus=0.5 --set decode.resources.num_gpus=0.5 \
        > "$OUT/shared_serve.log" 2>&1 &
      serve=$!
      for _ in $(seq 300); do
        curl -sf 127.0.0.1:8011/health > /dev/null && break
        kill -0 $serve 2> /dev/null || break
        sleep 1
      done
      curl -s 127.0.0.1:8011/v1/completions -H 'content-type: application/json' \
        -d '{"prompt": [128000, 791, 6864, 315, 9822, 374], "max_tokens": 8, "temperature": 0}' \
        | tee "$OUT/shared_answer.json"; echo
      kill -INT $serve 2> /dev/null; wait $serve
      grep -E "KV cache|Error|error" "$OUT/shared_serve.log" | tail -8 ;;
    cluster|bench|goodput)
      if [ "$GPUS" -lt 2 ]; then
        echo "skipped: configs/gpu_1p1d.yaml puts prefill and decode on two GPUs, this machine has $GPUS"
        continue
      fi
      if [ $step = cluster ]; then
        python scripts/gpu_cluster_check.py 2>&1 | tee "$OUT/gpu_cluster.log" | grep -v "^\s*$" | tail -60
      elif [ $step = goodput ]; then
        # Distinct random prompts at every rate (no prefix-cache help across rates); the rates
        # go past the knee of both modes.
        python -m cluster.bench configs/gpu_1p1d.yaml --compare aggregated --tokenizer none \
          --vocab-size 128000 --num-prompts 200 --input-len 4096 --output-len 256 \
          --request-rate ${GOODPUT_RATES:-1 2 4 6 8 12 16} --fresh-prompts-per-rate --goodput ttft:1000 tpot:50 \
          --disable-tqdm --output-dir "$OUT/goodput" 2>&1 \
          | tee "$OUT/goodput.log" | tail -60
      else
        python -m cluster.bench configs/gpu_1p1d.yaml --compare aggregated --tokenizer none \
          --vocab-size 128000 --num-prompts 32 --input-len 2048 --output-len 64 --request-rate 2 8 inf \
          --disable-tqdm --no-plots --output-dir "$OUT/bench" 2>&1 | tee "$OUT/gpu_bench.log" | tail -60
      fi ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
