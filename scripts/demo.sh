#!/usr/bin/env bash
# The whole CPU path on the embedded default, a few minutes on 2 cores:
#   toy verifier -> prepare -> extract -> train -> eval (teacher-forced, then decoded) -> export.
# Every step is idempotent or resumable: rerunning skips finished work.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
D=${DSPARK_DEMO:-cache}
DATA=$(.venv/bin/python -c "from dspark.verifier.toy import demo_chat_path; print(demo_chat_path())")
dspark() { .venv/bin/dspark "$@"; }
set -x
[ -f "$D/models/tiny/model.safetensors" ] || dspark toy-verifier --output "$D/models/tiny"
dspark prepare --model "$D/models/tiny" --data "$DATA" --output "$D/prepared/demo" \
    --seq-length 512 --num-preprocessing-workers 2 --minimum-valid-tokens 16
dspark extract --to zarr --model "$D/models/tiny" --data "$D/prepared/demo" \
    --store "$D/stores/demo" --target-layer-ids 1 3 5 --no-progress
dspark store info "$D/stores/demo"
dspark train --config scripts/configs/demo.yaml --from zarr --store "$D/stores/demo" \
    --data-path "$D/prepared/demo" --verifier-name-or-path "$D/models/tiny" --save-path "$D/runs/demo"
# Held-out prompt sets, one per task (another seed than the training data), and a LongBench-format file.
.venv/bin/python scripts/make_demo_chat.py --tasks "$D/prompts/tasks"
dspark longbench --output "$D/prompts/longbench.jsonl" --model "$D/models/tiny" --lengths 1024 2048 8192 \
    --per-length 1
# Teacher-forced acceptance on the store, then real speculative decoding (greedy, as vLLM's DSpark
# speculator drafts) on each prompt set, against the verifier alone.
dspark eval --checkpoint "$D/runs/demo/latest" --decode --prompts "$D/prompts/tasks/arithmetic.jsonl" \
    --prompts "$D/prompts/tasks/spelling.jsonl" --prompts "$D/prompts/tasks/echo.jsonl" \
    --prompts longbench="$D/prompts/longbench.jsonl" --max-prompts 10 --max-new-tokens 64 --no-progress
# After eval, so the model card embeds its tables and plots.
dspark export "$D/runs/demo/latest" --output "$D/export/demo" --verifier-name dspark/tiny-verifier
set +x
echo; echo "Decoded acceptance (also in $D/export/demo/README.md, the model card):"; echo
cat "$D/runs/demo/latest/eval/decode.md"
