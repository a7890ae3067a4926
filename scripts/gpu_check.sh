#!/usr/bin/env bash
# What only a GPU exercises in the vLLM extractor: the side-stream device->host copy into pinned
# staging, and (with 2+ GPUs) tensor parallelism where rank 0 alone writes. Run where CUDA and
# vLLM 0.33 exist (`bash scripts/setup.sh --vllm` picks vllm==0.33.0 when nvidia-smi answers).
# It extracts the same samples with vLLM and with the transformers engine on the GPU and compares;
# then serves a drafter in DSpark's layout with `method: dspark` (Model Runner V2, GPU only) through
# `dspark serve-draft`, and `dspark bench` reads its acceptance from vLLM's counters.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${DSPARK_GPU_CHECK:-cache/gpu-check}
TP=$(nvidia-smi -L | wc -l); TP=$(( TP >= 2 ? 2 : 1 ))
dspark() { .venv/bin/dspark "$@"; }
set -x
[ -f "$W/tiny/model.safetensors" ] || dspark toy-verifier --output "$W/tiny"
dspark prepare --model "$W/tiny" --data "$(.venv/bin/python -c 'from dspark.toy import demo_chat_path; print(demo_chat_path())')" \
    --output "$W/prepared" --seq-length 512 --minimum-valid-tokens 16
dspark extract --to zarr --model "$W/tiny" --data "$W/prepared" --store "$W/ref" --target-layer-ids 1 3 5 \
    --device cuda --dtype float32 --no-progress
# TP=1: the side-stream copy into pinned staging, through `dspark extract --engine vllm`.
.venv-vllm/bin/dspark extract --engine vllm --to zarr --model "$W/tiny" --data "$W/prepared" --store "$W/vllm" \
    --target-layer-ids 1 3 5 --dtype float32 --no-progress
if [ "$TP" -ge 2 ]; then  # TP=2 through the launcher: rank 0 alone writes, every request still finishes
  .venv-vllm/bin/python scripts/launch_vllm.py "$W/tiny" --hidden-states-backend zarr --store "$W/vllm-tp2" \
      --data "$W/prepared" --target-layer-ids 1 3 5 -- --port 8765 --tensor-parallel-size 2 --dtype float32 &
  LAUNCHER=$!
  until curl -sf localhost:8765/health >/dev/null; do sleep 2; done
  MODEL=$(curl -s localhost:8765/v1/models | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
  FP=$(.venv/bin/python -c "import json; print(json.load(open('$W/prepared/prepare.json'))['fingerprint'])")
  for i in 0 1 2 3; do
    TOK=$(.venv/bin/python -c "from dspark.prepare import PreparedData; print(PreparedData('$W/prepared').token_ids($i).tolist())")
    curl -sf localhost:8765/v1/completions -H 'Content-Type: application/json' -d "{\"model\": \"$MODEL\", \"prompt\": $TOK, \"max_tokens\": 1, \"kv_transfer_params\": {\"sample_id\": $i, \"prepared_fingerprint\": \"$FP\"}}" >/dev/null
  done
  kill -TERM $LAUNCHER; wait $LAUNCHER || true
  dspark store verify "$W/vllm-tp2" --no-progress
fi
dspark store verify "$W/vllm" --no-progress
.venv/bin/python - "$W" <<'PY'
import sys
from dspark.connector.zarr.reader import ZarrStore
v, t = ZarrStore(f"{sys.argv[1]}/vllm"), ZarrStore(f"{sys.argv[1]}/ref")
assert v.sample_ids == t.sample_ids
worst = max((v.read(i).hidden_states - t.read(i).hidden_states).abs().max().item() for i in v.sample_ids)
print(f"GPU vLLM vs transformers, fp32: max |diff| {worst:.3g} over {len(v)} samples")
assert worst < 1e-3, worst
PY

# serve-draft + bench: what a CPU cannot run. A drafter in DSpark's layout (the default) is served with
# `method: dspark` on Model Runner V2; bench reads vLLM's counters and compares with the verifier alone.
dspark train --config scripts/configs/demo.yaml --from zarr --store "$W/ref" --data-path "$W/prepared" \
    --verifier-name-or-path "$W/tiny" --save-path "$W/run" --device cuda --no-progress
dspark export "$W/run/latest" --output "$W/export" --verifier-name dspark/tiny-verifier
.venv-vllm/bin/dspark serve-draft --verifier "$W/tiny" --drafter "$W/export" --port 8766 --dtype float32 &
DRAFTED=$!
.venv-vllm/bin/dspark serve-draft --verifier "$W/tiny" --method none --port 8767 --dtype float32 &
ALONE=$!
trap 'kill -TERM $DRAFTED $ALONE 2>/dev/null || true' EXIT
until curl -sf localhost:8766/health >/dev/null && curl -sf localhost:8767/health >/dev/null; do sleep 2; done
CHAT=$(.venv/bin/python -c 'from dspark.toy import demo_chat_path; print(demo_chat_path())')
dspark bench --endpoint http://127.0.0.1:8766 --compare-endpoint http://127.0.0.1:8767 --prompts demo="$CHAT" \
    --max-prompts 20 --max-tokens 64 --ignore-eos --concurrency 4 --output "$W/bench" --no-progress
dspark eval --checkpoint "$W/run/latest" --decode --prompts demo="$CHAT" --max-prompts 20 --max-new-tokens 64 \
    --ignore-eos --no-confidence --no-progress --output "$W/predicted"
.venv/bin/python - "$W" <<'PY'
import json, sys
served = json.load(open(f"{sys.argv[1]}/bench/bench.json"))["datasets"][0]
ours = json.load(open(f"{sys.argv[1]}/predicted/decode.json"))["datasets"][0]["decoded"]
spec = served["runs"][0]["spec"]
assert spec and spec["drafts"] > 0, "method dspark served no drafts"
print(f"method dspark in vLLM: mean acceptance length {spec['mean_acceptance_length']:.2f}, speedup "
      f"{served['speedup']:.2f}x over the verifier alone; our decode loop: {ours['mean_acceptance_length']:.2f}")
print("per position, vLLM / ours:", [(round(a["rate"], 3), round(b["rate"], 3))
                                     for a, b in zip(spec["positions"], ours["positions"])])
PY
