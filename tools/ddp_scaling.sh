#!/usr/bin/env bash
# DDP scaling efficiency of a profile: trains it on 1 GPU and on N GPUs (torchrun) and prints
# (N-GPU char/s) / (N x 1-GPU char/s), read from the last history record of each run: the interval
# between the last two records, so torch.compile warm-up and start-up stay out of it.
#   bash tools/ddp_scaling.sh OUT_DIR [N=2] [PROFILE=h200] [STEPS=200] [--set key=value ...]
# Runs go to /dev/shm when it exists: a 410M-parameter checkpoint with its optimizer is ~5 GB, and
# writing it to a slow disk costs more than the measured steps.
set -uo pipefail
out=${1:?usage: ddp_scaling.sh OUT_DIR [N] [PROFILE] [STEPS]}
n=${2:-2}; profile=${3:-h200}; steps=${4:-200}; extra=("${@:5}")
mkdir -p "$out"
runs=/dev/shm/minagi_runs; [ -d /dev/shm ] || runs=runs
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for world in 1 "$n"; do
  rm -rf "${runs:?}/scale$world" "$out/history_scale_$world.jsonl"  # scratch runs: a fresh one each time
  torchrun --nproc_per_node="$world" train.py --profile "$profile" --run-name "scale$world" \
    --set train.out_dir="$runs" --set train.steps="$steps" --set train.eval_every=$((steps / 2)) \
    --set train.warmup_steps=$((steps / 10)) "${extra[@]}" \
    2>&1 | tr '\r' '\n' | grep -E "^step|final|rror" | tee "$out/scale_$world.txt"
  cp "$runs/scale$world/history.jsonl" "$out/history_scale_$world.jsonl" || exit 1
done
python3 - "$out" "$n" <<'PY'
import json, sys
out, n = sys.argv[1], int(sys.argv[2])
last = lambda w: [json.loads(l) for l in open(f"{out}/history_scale_{w}.jsonl")][-1]["chars_per_s"]
one, many = last(1), last(n)
print(f"1 GPU {one:,.0f} char/s; {n} GPUs {many:,.0f} char/s; scaling efficiency {many / (n * one):.1%}")
PY
