#!/usr/bin/env bash
# The learning-quality runs of docs/quality.md, in one go on one GPU:
#   1. nanoGPT's shakespeare_char beside them, if a copy of nanoGPT is in .ref/nanoGPT (never committed:
#      fetch karpathy/nanoGPT there and put tinyshakespeare.txt in its data/shakespeare_char/input.txt);
#   2. tinyshakespeare: h200_shakespeare (MoE), two seeds one at a time (their wall time is compared
#      with nanoGPT's), then h200_shakespeare_dense, two seeds at once (compared by held-out loss);
#   3. Gutenberg: h200_gutenberg and h200_gutenberg_dense, two seeds each, and the MoE's sink
#      experiments (seed 1337 with the balance term off, and off with the aux-free bias on), six at
#      once (compared at equal characters seen, so sharing the GPU changes nothing they are judged on);
#   4. AdamW's moments in fp32 against bf16 (train.optimizer_states) on h200_shakespeare, two seeds each,
#      four at once (compared by held-out loss);
#   5. every best.pt read over its whole held-out text by tools/evaluate.py, tools/compare_runs.py,
#      and tools/sink_report.py on every Gutenberg MoE run.
#
#   bash tools/quality_runs.sh OUT [DATA]      # DATA: the folder holding tinyshakespeare.txt and gutenberg/
#   STAGES="gutenberg evaluate" bash tools/quality_runs.sh OUT    # some stages only
#   STAGES="states evaluate" bash tools/quality_runs.sh OUT       # fp32 against bf16 optimizer states (~4 min)
set -u
OUT=${1:?usage: quality_runs.sh OUT [DATA]}
DATA=${2:-../shared/data}
RUNS=${RUNS:-/dev/shm/quality}
STAGES=${STAGES:-nanogpt shakespeare gutenberg states evaluate}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
shopt -s nullglob   # a stage not run leaves no runs to evaluate
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # run from the clone: the tools import its minagi, installed or not
stamp() { python3 -c "import sys, time; t = time.time(); [print(f'{time.time() - t:8.2f} {l}', end='', flush=True) for l in sys.stdin]"; }
common=(--set "train.out_dir=$RUNS" --set "data.cache_dir=$RUNS/cache")

if stage nanogpt && [ -d .ref/nanoGPT ]; then
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
if stage shakespeare; then
  for seed in 1337 1338; do
    echo "=== h200_shakespeare seed $seed $(date +%T)"
    shakespeare h200_shakespeare $seed
    tail -2 "$OUT/h200_shakespeare-$seed.txt"
  done
  echo "=== h200_shakespeare_dense x2 $(date +%T)"
  for seed in 1337 1338; do shakespeare h200_shakespeare_dense $seed & done
  wait
fi

gutenberg() {  # profile run-name seed [--set ...]
  local profile=$1 name=$2 seed=$3; shift 3
  python3 train.py --profile $profile --data "$DATA/gutenberg/*.txt" --run-name "$name" \
    --set "train.seed=$seed" "${common[@]}" "$@" 2>&1 | stamp > "$OUT/$name.txt"
}
if stage gutenberg; then
  echo "=== gutenberg x6 $(date +%T)"
  for seed in 1337 1338; do
    for profile in h200_gutenberg h200_gutenberg_dense; do gutenberg $profile "$profile-$seed" $seed & done
  done
  gutenberg h200_gutenberg h200_gutenberg_nobalance-1337 1337 --set pool.balance_coef=0 &
  gutenberg h200_gutenberg h200_gutenberg_auxfree-1337 1337 --set pool.balance_coef=0 --set pool.aux_free_bias=true &
  wait
  tail -n 1 "$OUT"/h200_gutenberg*.txt
fi

if stage states; then
  echo "=== h200_shakespeare optimizer states fp32 / bf16 x2 $(date +%T)"
  for states in fp32 bf16; do
    for seed in 1337 1338; do
      python3 train.py --profile h200_shakespeare --data "$DATA/tinyshakespeare.txt" \
        --run-name "h200_shakespeare_states_$states-$seed" --set "train.seed=$seed" \
        --set "train.optimizer_states=$states" "${common[@]}" 2>&1 | stamp > "$OUT/h200_shakespeare_states_$states-$seed.txt" &
    done
  done
  wait
  tail -n 1 "$OUT"/h200_shakespeare_states_*.txt
fi

stage evaluate || exit 0
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
compare() {  # name run...: one PNG and table of these runs, if any ran
  local name=$1; shift
  [ $# -gt 0 ] && python3 tools/compare_runs.py "$@" --out "$OUT/$name.png" > "$OUT/${name}_table.md" 2>&1
}
compare shakespeare "$RUNS"/h200_shakespeare-* "$RUNS"/h200_shakespeare_dense-*
compare states "$RUNS"/h200_shakespeare_states_*-*
compare gutenberg "$RUNS"/h200_gutenberg-* "$RUNS"/h200_gutenberg_dense-*
compare gutenberg_sinks "$RUNS"/h200_gutenberg-1337 "$RUNS"/h200_gutenberg_nobalance-* "$RUNS"/h200_gutenberg_auxfree-*
mkdir -p "$OUT/histories"
for run in "$RUNS"/h200_*-*; do cp "$run/history.jsonl" "$OUT/histories/$(basename "$run").jsonl"; done
for run in "$RUNS"/h200_gutenberg-* "$RUNS"/h200_gutenberg_nobalance-* "$RUNS"/h200_gutenberg_auxfree-*; do  # sinks per row
  python3 tools/sink_report.py "$run/best.pt" --device cuda > "$OUT/sinks-$(basename "$run").txt" 2>&1
done
cat "$OUT"/*_table.md
echo "=== done $(date +%T)"
