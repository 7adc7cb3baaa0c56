#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md in one go: GPU tests, the dispatch sweep, short training
# runs of the GPU profiles with their history (memory at every checkpoint), DDP through torchrun
# on one GPU (NCCL), and sampling speed.
#   bash tools/h200_figures.sh OUT_DIR
set -uo pipefail
out=${1:?usage: h200_figures.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
python3 -m pytest -q -m gpu 2>&1 | tail -3 | tee "$out/pytest_gpu.txt"
for run in 1 2; do  # the targets, twice
  python3 tools/bench_dispatch.py --chars 16384 --paths native grouped rectangle --repeat 50 \
    --json "$out/bench_target_$run.json" 2>/dev/null | tee "$out/bench_target_$run.md"
done
python3 tools/bench_dispatch.py --json "$out/bench_dispatch.json" 2>/dev/null | tee "$out/bench_dispatch.md"
# Runs go to /dev/shm where there is one: the h200 profile's checkpoint is ~5 GB.
runs=/dev/shm/minagi_runs; [ -d /dev/shm ] || runs=runs
train() {  # profile steps eval_every [launcher...]
  local profile=$1 steps=$2 every=$3; shift 3
  timeout 170 "$@" train.py --profile "$profile" --run-name "gpu_$profile" --set train.steps="$steps" \
    --set train.eval_every="$every" --set train.warmup_steps=20 --set train.out_dir="$runs" 2>&1 \
    | tr '\r' '\n' | grep -E "^step|final|rror|arn" | tee "$out/train_$profile.txt"
  cp "$runs/gpu_$profile/history.jsonl" "$out/history_$profile.jsonl"
}
train h200 300 100 python3
train strix_large 100 50 python3
train cuda_small 300 100 torchrun --nproc_per_node=1
python3 sample.py "$runs/gpu_cuda_small" --chars 2000 --no-echo 2>&1 >/dev/null | tail -2 | tee "$out/sample.txt"
