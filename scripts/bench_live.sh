#!/usr/bin/env bash
# Fraction of train step time spent waiting for data in live mode, cache cold vs warm.
# Starts a loopback mooncake_master and `dspark serve` on the demo verifier (run
# scripts/demo.sh first), trains one epoch live into a fresh cache (cold), then the
# same epoch again from the filled cache (warm). Reports figures; asserts nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
D=${DSPARK_DEMO:-cache}
W=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$W"' EXIT
.venv/bin/dspark mooncake-master --port 50061 --metrics-port 9063 >"$W/master.log" 2>&1 &
.venv/bin/python -m dspark.core.net wait tcp://127.0.0.1:50061 --timeout 30
.venv/bin/dspark serve --model "$D/models/tiny" --port 8061 --hidden-states-backend mooncake \
    --mooncake-master 127.0.0.1:50061 --target-layer-ids 1 3 5 --data "$D/prepared/demo" >"$W/serve.log" 2>&1 &
.venv/bin/python -m dspark.core.net wait http://127.0.0.1:8061/health --timeout 300
for run in cold warm; do
  .venv/bin/dspark train --from mooncake --vllm-endpoint http://127.0.0.1:8061/v1 --on-generate delete \
      --cache "$W/cache" --data-path "$D/prepared/demo" --verifier-name-or-path "$D/models/tiny" \
      --save-path "$W/run-$run" --target-layer-ids 1 3 5 --max-anchors 64 --markov-rank 32 --epochs 1 \
      --total-seq-len 1024 --log-freq 5 --lr 3e-3 --mooncake-master 127.0.0.1:50061 \
      --mooncake-global-segment-gib 0 --no-progress >"$W/train-$run.json" 2>"$W/train-$run.err"
done
.venv/bin/python - "$W" <<'PY'
import json, sys
w = sys.argv[1]
print("| cache | data-wait fraction of step time (mean over log windows) | extraction requests |")
print("|---|---:|---:|")
for run in ("cold", "warm"):
    recs = [json.loads(l) for l in open(f"{w}/run-{run}/metrics.jsonl") if '"train"' in l]
    frac = sum(r["timing"]["data_wait_fraction"] for r in recs) / len(recs)
    reqs = recs[-1]["live"]["requests"]
    print(f"| {run} | {frac:.3f} | {reqs} |")
PY
