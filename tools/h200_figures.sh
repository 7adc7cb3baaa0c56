#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md in one go: GPU tests, the dispatch sweep, and short
# training runs of the GPU profiles with their history (memory at every checkpoint).
#   bash tools/h200_figures.sh OUT_DIR
set -uo pipefail
out=${1:?usage: h200_figures.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
python3 -m pytest -q -m gpu 2>&1 | tail -3 | tee "$out/pytest_gpu.txt"
python3 tools/bench_dispatch.py --json "$out/bench_dispatch.json" 2>/dev/null | tee "$out/bench_dispatch.md"
for spec in "h200 300 100" "cuda_small 300 100" "strix_large 100 50"; do
  set -- $spec
  python3 train.py --profile "$1" --run-name "gpu_$1" --set train.steps="$2" --set train.eval_every="$3" \
    --set train.warmup_steps=20 2>&1 | tr '\r' '\n' | grep -E "^step|final|rror" | tee "$out/train_$1.txt"
  cp "runs/gpu_$1/history.jsonl" "$out/history_$1.jsonl"
done
