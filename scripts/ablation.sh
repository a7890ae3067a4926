#!/usr/bin/env bash
# DSpark vs a DFlash-only ablation (no Markov head, no confidence head), trained the same way
# on the demo store (run scripts/demo.sh first). Prints validation tau for both. Reports
# figures; asserts nothing. Usage: bash scripts/ablation.sh [EPOCHS]
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
D=${DSPARK_DEMO:-cache}
EPOCHS=${1:-6}
common=(--config scripts/configs/demo.yaml --from zarr --store "$D/stores/demo" --data-path "$D/prepared/demo"
        --verifier-name-or-path "$D/models/tiny" --epochs "$EPOCHS" --no-progress)
.venv/bin/dspark train "${common[@]}" --save-path "$D/runs/ablation-dspark-e$EPOCHS" --markov-rank 32 \
    --enable-confidence-head --confidence-head-with-markov
.venv/bin/dspark train "${common[@]}" --save-path "$D/runs/ablation-dflash-e$EPOCHS" --markov-rank 0 \
    --no-enable-confidence-head --no-confidence-head-with-markov
for arm in dspark dflash; do
  .venv/bin/dspark eval --checkpoint "$D/runs/ablation-$arm-e$EPOCHS/latest" --store "$D/stores/demo" \
      --output "$D/runs/ablation-$arm-e$EPOCHS/eval" > /dev/null
done
.venv/bin/python - "$D" "$EPOCHS" <<'PY'
import json, sys
d, e = sys.argv[1], sys.argv[2]
print(f"| arm (epochs {e}) | val tau greedy | val tau analytic | pos1 1-TV | pos8 1-TV |")
print("|---|---:|---:|---:|---:|")
for arm in ("dspark", "dflash"):
    r = json.load(open(f"{d}/runs/ablation-{arm}-e{e}/eval/eval.json"))
    p = r["positions"]
    print(f"| {arm} | {r['tau_greedy']:.3f} | {r['tau_analytic']:.3f} | {p[0]['analytic_accept']:.3f} | {p[-1]['analytic_accept']:.3f} |")
PY
