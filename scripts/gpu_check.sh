#!/usr/bin/env bash
# GPU work of one device call, on a 2-GPU machine: `. .gpu/setup.sh` first (see README of the GPU
# machines), then this. Results go under $OUT (or ./out). STEPS picks what runs (default: all):
#   tests     GPU tests of kernels/, transfer/ (CUDA IPC between two processes included), kvcache/ and the engine (the KV host tier over pinned memory, hybrid models)
#   pagecopy  scripts/bench_page_copy.py: the direct path's copy kernel variants vs peer copy
#   transfer  scripts/bench_transfer.py, 1 MiB .. 1 GiB: ucx and direct paths, raw ucxx, peer copy
#   direct    the same with the direct path alone (its process then runs as a direct decode worker),
#             and its pulls also timed back to back (--hot)
#   async     the direct path's pulls also awaited on an event loop, 16 MiB .. 1 GiB; asyncload: the
#             same next to a thread that runs Python nonstop
#   cpuhost   the CPU benchmark (host pools, both paths) on this host's cores, CPU_RUNS times
#             (default 3): the staged UCX path where copies do not compete with UCX for 2 cores
#   cpuab     the CPU benchmark's staged UCX path (scattered pages, 16-256 MiB) on this host's cores,
#             alternating chunk sizes (CPU_TOKENS, default "1024 512") and prestaging on / off,
#             CPU_RUNS rounds (default 2)
#   cpuseg    the CPU benchmark's UCX path (1-256 MiB) on this host's cores, alternating UCX's TCP
#             TX segments: ours (64k) and UCX's default (8k), CPU_RUNS rounds (default 2)
#   cpuiov    the CPU benchmark's UCX path (1-256 MiB) on this host's cores with 8 MiB chunks,
#             scattered host pages as UCX piece lists (--host-iov) and staged (--no-host-iov)
#             alternating, CPU_RUNS rounds (default 2), then piece lists with the default 64 MiB
#   cpupaired the CPU benchmark's UCX path (1-256 MiB, scattered and contiguous pages, 15 repeats)
#             on this host's cores, piece chunks of CPU_PIECES tokens (default: 16384, the
#             library's, then 4096, one staging buffer) alternating, CPU_RUNS rounds (default 3)
#   probe     scripts/probe_read_path.py: host cost of each launch step, device time of copy variants
#   lean      scripts/probe_lean_pull.py and probe_cold_pull.py: a pull after P's answer next to its
#             bare steps and a peer copy, and its timeline step by step
#   profile   scripts/profile_direct_read.py: where the time of a direct read goes, per phase
#   cluster   scripts/gpu_cluster_check.py: 1P1D vs aggregated tokens, transfer path and figures
#   bench     duet bench of configs/gpu_1p1d.yaml against its aggregated twin
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0   # keep Ray on loopback
for step in ${STEPS:-tests transfer cluster bench}; do
  echo "== $step"
  case $step in
    tests)
      python -m pytest -q -m gpu tests/kernels tests/transfer tests/kvcache tests/engine ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -15 ;;
    pagecopy)
      python scripts/bench_page_copy.py --out "$OUT/page_copy_gpu.json" 2>&1 | tee "$OUT/page_copy.log" | tail -8 ;;
    transfer)
      python scripts/bench_transfer.py --device cuda --min-mib 1 --max-mib 1024 --repeats 5 \
        --out "$OUT/transfer_gpu.json" 2>&1 | tee "$OUT/transfer_gpu.log" | tail -14 ;;
    direct)
      python scripts/bench_transfer.py --device cuda --paths direct --hot --min-mib 1 --max-mib 1024 \
        --repeats 9 --out "$OUT/transfer_gpu_direct.json" 2>&1 | tee "$OUT/transfer_gpu_direct.log" | tail -14 ;;
    async|asyncload)
      python scripts/bench_transfer.py --device cuda --paths direct --async --min-mib 16 \
        --max-mib 1024 --repeats 9 $([ $step = asyncload ] && echo --gil-load) \
        --out "$OUT/transfer_gpu_$step.json" 2>&1 | tee "$OUT/transfer_gpu_$step.log" | tail -8 ;;
    cpuhost)
      echo "$(nproc) cores" | tee "$OUT/transfer_cpu_host.log"
      for run in $(seq "${CPU_RUNS:-3}"); do
        python scripts/bench_transfer.py --device cpu --repeats 9 \
          --out "$OUT/transfer_cpu_host_run$run.json" 2>&1 | tee -a "$OUT/transfer_cpu_host.log" | tail -10
      done ;;
    cpuab)
      for run in $(seq "${CPU_RUNS:-2}"); do
        for tokens in ${CPU_TOKENS:-1024 512}; do
          for pre in prestage no-prestage; do
            echo "run $run, $tokens tokens a chunk, --$pre" | tee -a "$OUT/transfer_cpu_ab.log"
            python scripts/bench_transfer.py --device cpu --paths ucx --layouts scattered \
              --min-mib 16 --max-mib 256 --repeats 9 --staging-tokens "$tokens" --$pre \
              --out "$OUT/transfer_cpu_ab_${tokens}_${pre}_run$run.json" 2>&1 \
              | tee -a "$OUT/transfer_cpu_ab.log" | tail -5
          done
        done
      done ;;
    cpuseg)
      for run in $(seq "${CPU_RUNS:-2}"); do
        for seg in 64k 8k; do
          echo "run $run, UCX_TCP_TX_SEG_SIZE=$seg" | tee -a "$OUT/transfer_cpu_seg.log"
          UCX_TCP_TX_SEG_SIZE=$seg python scripts/bench_transfer.py --device cpu --paths ucx \
            --repeats 9 --out "$OUT/transfer_cpu_seg_${seg}_run$run.json" 2>&1 \
            | tee -a "$OUT/transfer_cpu_seg.log" | tail -9
        done
      done ;;
    cpuiov)
      for run in $(seq "${CPU_RUNS:-2}"); do
        for mode in host-iov no-host-iov; do
          echo "run $run, --$mode" | tee -a "$OUT/transfer_cpu_iov.log"
          python scripts/bench_transfer.py --device cpu --paths ucx --repeats 7 --$mode --staging-tokens 512 \
            --out "$OUT/transfer_cpu_${mode}_run$run.json" 2>&1 | tee -a "$OUT/transfer_cpu_iov.log" | tail -9
        done
      done
      echo "--host-iov, 4096 tokens a chunk" | tee -a "$OUT/transfer_cpu_iov.log"
      python scripts/bench_transfer.py --device cpu --paths ucx --repeats 7 \
        --out "$OUT/transfer_cpu_host-iov_4096.json" 2>&1 | tee -a "$OUT/transfer_cpu_iov.log" | tail -9 ;;
    cpupaired)
      for run in $(seq "${CPU_RUNS:-3}"); do
        for piece in ${CPU_PIECES:-16384 4096}; do
          echo "run $run, --piece-chunk-tokens $piece, $(nproc) cores" | tee -a "$OUT/transfer_cpu_paired.log"
          python scripts/bench_transfer.py --device cpu --paths ucx --layouts scattered contiguous \
            --repeats 15 --piece-chunk-tokens "$piece" \
            --out "$OUT/transfer_cpu_paired_${piece}_run$run.json" 2>&1 \
            | tee -a "$OUT/transfer_cpu_paired.log" | tail -9
        done
      done ;;
    probe)
      python scripts/probe_read_path.py 2>&1 | tee "$OUT/probe_read_path.log" | tail -40 ;;
    lean)
      python scripts/probe_lean_pull.py 2>&1 | tee "$OUT/probe_lean_pull.log" | grep "MiB"
      python scripts/probe_cold_pull.py 2>&1 | tee "$OUT/probe_cold_pull.log" | grep "MiB" ;;
    profile)
      # (no `head` here: closing the pipe early kills the script before its larger sizes)
      python scripts/profile_direct_read.py 2>&1 | tee "$OUT/profile_direct_read.log" | grep "MiB (" ;;
    cluster)
      python scripts/gpu_cluster_check.py 2>&1 | tee "$OUT/gpu_cluster.log" | grep -v "^\s*$" | tail -60 ;;
    bench)
      python -m cluster.bench configs/gpu_1p1d.yaml --compare aggregated --tokenizer none \
        --vocab-size 128000 --num-prompts 32 --input-len 2048 --output-len 64 --request-rate 2 8 inf \
        --disable-tqdm --no-plots --output-dir "$OUT/bench" 2>&1 | tee "$OUT/gpu_bench.log" | tail -60 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
