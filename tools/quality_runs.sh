#!/usr/bin/env bash
# The learning-quality runs of docs/quality.md, in one go on one GPU:
#   1. nanoGPT's shakespeare_char beside them, if a copy of nanoGPT is in .ref/nanoGPT (never committed:
#      fetch karpathy/nanoGPT there and put tinyshakespeare.txt in its data/shakespeare_char/input.txt);
#   2. tinyshakespeare: h200_shakespeare (MoE), two seeds one at a time (their wall time is compared
#      with nanoGPT's), then h200_shakespeare_dense, two seeds at once (compared by held-out loss);
#   3. Gutenberg: h200_gutenberg and h200_gutenberg_dense, two seeds each, four at once (compared at
#      equal characters seen, so sharing the GPU changes nothing they are judged on);
#   4. every best.pt read over its whole held-out text by tools/evaluate.py, and tools/compare_runs.py.
#
#   bash tools/quality_runs.sh OUT [DATA]      # DATA: the folder holding tinyshakespeare.txt and gutenberg/
set -u
OUT=${1:?usage: quality_runs.sh OUT [DATA]}
DATA=${2:-../shared/data}
RUNS=${RUNS:-/dev/shm/quality}
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1
stamp() { python3 -c "import sys, time; t = time.time(); [print(f'{time.time() - t:8.2f} {l}', end='', flush=True) for l in sys.stdin]"; }
common=(--set "train.out_dir=$RUNS" --set "data.cache_dir=$RUNS/cache")

if [ -d .ref/nanoGPT ]; then
  echo "=== nanoGPT $(date +%T)"
  (cd .ref/nanoGPT/data/shakespeare_char && python3 prepare.py) > "$OUT/nanogpt_prepare.txt" 2>&1
  (cd .ref/nanoGPT && python3 train.py config/train_shakespeare_char.py --max_iters=2000 --lr_decay_iters=2000 \
     --out_dir="$RUNS/nanogpt" 2>&1 | stamp) > "$OUT/nanogpt.txt"
  grep -E "^ *[0-9.]+ step " "$OUT/nanogpt.txt" | tail -3
fi

shakespeare() {  # profile seed
  python3 train.py --profile $1 --data "$DATA/tinyshakespeare.txt" --run-name "$1-$2" \
    --set "train.seed=$2" "${common[@]}" 2>&1 | stamp > "$OUT/$1-$2.txt"
}
for seed in 1337 1338; do
  echo "=== h200_shakespeare seed $seed $(date +%T)"
  shakespeare h200_shakespeare $seed
  tail -2 "$OUT/h200_shakespeare-$seed.txt"
done
echo "=== h200_shakespeare_dense x2 $(date +%T)"
for seed in 1337 1338; do shakespeare h200_shakespeare_dense $seed & done
wait

echo "=== gutenberg x4 $(date +%T)"
for seed in 1337 1338; do
  for profile in h200_gutenberg h200_gutenberg_dense; do
    python3 train.py --profile $profile --data "$DATA/gutenberg/*.txt" --run-name "$profile-$seed" \
      --set "train.seed=$seed" "${common[@]}" > "$OUT/$profile-$seed.txt" 2>&1 &
  done
done
wait
tail -n 1 "$OUT"/h200_gutenberg*.txt

echo "=== held-out evaluation $(date +%T)"
# The Shakespeare figure is of the held-out part only: evaluate it as its own file.
python3 - "$DATA/tinyshakespeare.txt" "$RUNS/heldout_shakespeare.txt" <<'PY'
import sys
text = open(sys.argv[1], encoding="utf-8").read()
open(sys.argv[2], "w", encoding="utf-8").write(text[int(len(text) * 0.9):])
PY
for run in "$RUNS"/h200_shakespeare*-*; do
  python3 tools/evaluate.py "$run/best.pt" --data "$RUNS/heldout_shakespeare.txt" \
    --json "$OUT/heldout-$(basename "$run").json" > "$OUT/heldout-$(basename "$run").txt" 2>> "$OUT/eval_errors.txt"
done
for run in "$RUNS"/h200_gutenberg*-*; do
  python3 tools/evaluate.py "$run/best.pt" --strip-gutenberg --data "$DATA/gutenberg/pg11_alice_in_wonderland.txt" \
    "$DATA/gutenberg/pg84_frankenstein.txt" --json "$OUT/heldout-$(basename "$run").json" \
    > "$OUT/heldout-$(basename "$run").txt" 2>> "$OUT/eval_errors.txt"
done
python3 tools/compare_runs.py "$RUNS"/h200_shakespeare*-* --out "$OUT/shakespeare.png" > "$OUT/shakespeare_table.md" 2>&1
python3 tools/compare_runs.py "$RUNS"/h200_gutenberg*-* --out "$OUT/gutenberg.png" > "$OUT/gutenberg_table.md" 2>&1
mkdir -p "$OUT/histories"
for run in "$RUNS"/h200_*-*; do cp "$run/history.jsonl" "$OUT/histories/$(basename "$run").jsonl"; done
for run in "$RUNS"/h200_gutenberg-*; do  # the MoE runs' routing: sinks per row
  python3 tools/sink_report.py "$run/best.pt" --device cuda > "$OUT/sinks-$(basename "$run").txt" 2>&1
done
cat "$OUT/shakespeare_table.md" "$OUT/gutenberg_table.md"
echo "=== done $(date +%T)"
