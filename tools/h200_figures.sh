#!/usr/bin/env bash
# The one-GPU figures of docs/benchmarks.md in one go: GPU tests, NF4 dequant bandwidth, the dispatch
# targets, training throughput and MFU of the GPU profiles, frozen experts (pin against recompute,
# offload, memory), the optimizer step (bf16 states), h200_offload under its cap, a short h200 run, and writing speed.
#   bash tools/h200_figures.sh OUT_DIR        (~15 minutes on one H200, before the optimizer lines)
set -uo pipefail
out=${1:?usage: h200_figures.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # run from the clone: the tools import its minagi, installed or not
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
python3 -m pytest -q -m gpu 2>&1 | tail -3 | tee "$out/pytest_gpu.txt"
python3 tools/bench_nf4.py --tiles 2048:4 4096:8 1024:4 --json "$out/nf4.json" | tee "$out/nf4.md"           # §6
python3 tools/bench_dispatch.py --chars 16384 --paths native grouped rectangle --repeat 50 \
  --json "$out/bench_target.json" 2>/dev/null | tee "$out/bench_target.md"                                  # §1
python3 tools/bench_train.py --profiles h200 --compile off on --steps 25 --warmup 8 --trace \
  --json "$out/train_h200.json" | tee "$out/train_h200.md"                                                  # §10
python3 tools/bench_train.py --profiles cuda_small strix_small strix_large h200_gutenberg h200_gutenberg_dense \
  h200_shakespeare h200_shakespeare_dense --compile off --steps 12 --warmup 4 --sync-trace \
  --json "$out/train_mfu.json" | tee "$out/train_mfu.md"
python3 tools/bench_optim.py --profiles h200_shakespeare h200_gutenberg h200 | tee "$out/optim.md"          # bf16 states
python3 tools/bench_paired.py --profile h200_shakespeare --variant "train.optimizer_states=fp32" \
  --variant "train.optimizer_states=bf16" --json "$out/paired_states.json" | tee "$out/paired_states.md"
python3 tools/bench_frozen.py --profile h200_frozen --steps 6 --warmup 3 \
  --modes recompute pin offload-sync offload-prefetch --json "$out/frozen.json" | tee "$out/frozen.md"         # §7, §9
python3 tools/bench_frozen.py --profile h200_frozen --set pool.n_experts=64 --steps 3 --warmup 2 \
  --modes trainable frozen --json "$out/frozen_memory.json" | tee "$out/frozen_memory.md"                     # §8
# Runs go to /dev/shm where there is one: checkpoints of these profiles are GBs.
runs=/dev/shm/minagi_runs; [ -d /dev/shm ] || runs=runs
train() {  # profile steps eval_every [--set ...]
  local profile=$1 steps=$2 every=$3; shift 3
  timeout 300 python3 train.py --profile "$profile" --run-name "gpu_$profile" --set train.steps="$steps" \
    --set train.eval_every="$every" --set train.warmup_steps=5 --set train.out_dir="$runs" "$@" 2>&1 \
    | tr '\r' '\n' | grep -E "^step|final|rror|arn|offload" | tee "$out/train_$profile.txt"
  cp "$runs/gpu_$profile/history.jsonl" "$out/history_$profile.jsonl"
}
train h200 120 60                                                                                             # §2
train h200_offload 6 6 --set train.eval_batches=1                                                             # §9
train strix_large_frozen 30 15 --set pool.dispatch=grouped --set train.eval_batches=2
python3 tools/bench_decode.py --profile h200 --json "$out/decode_h200.json" | tee "$out/decode_h200.md"       # §11
python3 tools/bench_decode.py --profile cuda_small --json "$out/decode_cuda_small.json" | tee "$out/decode_cuda_small.md"
python3 tools/bench_decode.py --profile h200_offload --chars 40 --streams 64 \
  --json "$out/decode_offload.json" | tee "$out/decode_offload.md"                                            # §12
