#!/usr/bin/env bash
# What only a GPU exercises in the vLLM extractor and in serving, on your own GPU host with .venv
# (CUDA torch) and .venv-vllm (`bash scripts/setup.sh --vllm` picks vllm==0.33.0 when nvidia-smi
# answers). The trainer side alone, on a machine without vLLM: scripts/gpu_check_device.sh.
#   - extraction in bf16 (what production runs), each against the transformers engine in fp32 on
#     the CPU by relative L2: transformers on CUDA, vLLM with its default runner (Model Runner V2)
#     and with V1 (VLLM_USE_V2_MODEL_RUNNER=0); with 2+ GPUs, TP=2 where rank 0 alone writes;
#   - an abort probe: a request dropped mid-prefill (chunked, 32 tokens a step) leaves no partial
#     sample in the store, and the server serves the next one;
#   - a drafter served with `method: dspark` (Model Runner V2) and the verifier alone, measured by
#     `dspark bench`, beside `dspark eval --decode`.
# Servers run one after another, never two at once, each with GPU_MEM of the GPU, and each wait for
# /health has a timeout and fails at once if the server died (its log's tail is printed). Each step
# runs under its own timeout, a failed one is recorded and the next one runs; summary.txt,
# failures.txt and logs.tar.gz go to OUT (default cache/gpu-check). Exit status 1 if any failed.
# --dry-run (or DSPARK_GPU_CHECK_DRY=1): on the CPU with .venv alone, what needs no vLLM 0.33 or
# CUDA (the abort probe against `dspark serve`, the CPU stand-in, beside the drafter's export and eval;
# DSPARK_GPU_CHECK_JOBS=1: one step at a time); CI runs it (tests/test_gpu_check.py),
# which checks the plumbing and so gives it its test session's inputs.
# Inputs given instead of built (unset, as on a real run: built here). Each is linked into the work
# folder, read and never written, and its step passes at once, saying `given: PATH`:
#   DSPARK_GPU_CHECK_VERIFIER  a toy verifier folder (skips toy-verifier)
#   DSPARK_GPU_CHECK_PREPARED  data prepared for it by `dspark prepare` (skips prepare; needs the verifier)
#   DSPARK_GPU_CHECK_STORE     a Zarr store of that data's fp32 CPU states at layers 1 3 5 (skips
#                              extract-fp32-cpu; needs the data)
#   DSPARK_GPU_CHECK_RUN       a drafter trained on that store: a `dspark train` save path (skips train;
#                              needs the store)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${DSPARK_GPU_CHECK_DRY:-0}
[ "${1:-}" != --dry-run ] || DRY=1
GIVEN_VERIFIER=${DSPARK_GPU_CHECK_VERIFIER:-} GIVEN_PREPARED=${DSPARK_GPU_CHECK_PREPARED:-}
GIVEN_STORE=${DSPARK_GPU_CHECK_STORE:-} GIVEN_RUN=${DSPARK_GPU_CHECK_RUN:-}
if { [ -n "$GIVEN_RUN" ] && [ -z "$GIVEN_STORE" ]; } || { [ -n "$GIVEN_STORE" ] && [ -z "$GIVEN_PREPARED" ]; } \
   || { [ -n "$GIVEN_PREPARED" ] && [ -z "$GIVEN_VERIFIER" ]; }; then
  echo "DSPARK_GPU_CHECK_RUN needs DSPARK_GPU_CHECK_STORE, which needs DSPARK_GPU_CHECK_PREPARED, which needs" \
    "DSPARK_GPU_CHECK_VERIFIER" >&2
  exit 2
fi
: "${OUT:=cache/gpu-check}"
: "${BUDGET:=3600}"
: "${GPU_MEM:=0.5}"          # one server at a time: half the GPU leaves room for anything else on it
: "${PORT:=8765}"
: "${READY_TIMEOUT:=600}"    # vLLM loads, compiles and captures graphs before /health answers
# shellcheck source=scripts/gpu_check_common.sh
. scripts/gpu_check_common.sh
DS=(.venv/bin/python -m dspark.cli)
VDS=(.venv-vllm/bin/python -m dspark.cli)
LIB=(.venv/bin/python scripts/gpu_check_lib.py)
URL=http://127.0.0.1:$PORT
if [ "$DRY" = 1 ]; then
  DEV=cpu TOY_STEPS=1 CHATS=40 STEPS=4 PROMPTS=2 TOKENS=16 TP=1
  # eval --decode's teacher-forced scores, calibration and cost profile, each on the least that runs it
  EVAL_SIZES=(--max-anchors 64 --calibration-max-prompts "$PROMPTS" --profile-repeats 1)
else
  DEV=cuda TOY_STEPS=150 CHATS=400 STEPS=0 PROMPTS=20 TOKENS=64 TP=$(nvidia-smi -L | wc -l) EVAL_SIZES=()
fi
CHAT=$W/chat.jsonl
head -n "$CHATS" "$(.venv/bin/python -c 'from dspark.verifier.toy import demo_chat_path; print(demo_chat_path())')" >"$CHAT"
LAYERS=(--target-layer-ids 1 3 5)

# serve NAME COMMAND...: start a server in its own process group, then wait for its /health.
serve() {
  local name=$1; shift
  setsid "$@" >"$LOGS/$name.log" 2>&1 &
  SERVER=$!
  step "$name-ready" "$READY_TIMEOUT" "${LIB[@]}" wait-ready "$URL" "$SERVER" "$LOGS/$name.log" "$READY_TIMEOUT"
}

# unserve: stop the server's whole group (vLLM's engine processes too) before the next one starts.
unserve() {
  kill -TERM -- "-$SERVER" 2>/dev/null || return 0
  for _ in $(seq 30); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$SERVER" 2>/dev/null
  wait "$SERVER" 2>/dev/null
  SERVER=
}
SERVER=
trap '[ -z "$SERVER" ] || unserve' EXIT

made_or_given toy-verifier "$GIVEN_VERIFIER" "$W/tiny" 300 "${DS[@]}" toy-verifier --output "$W/tiny" --steps "$TOY_STEPS"
made_or_given prepare "$GIVEN_PREPARED" "$W/prepared" 120 "${DS[@]}" prepare --model "$W/tiny" --data "$CHAT" \
  --output "$W/prepared" --seq-length 512 --minimum-valid-tokens 16
EXTRACT=(extract --to zarr --model "$W/tiny" --data "$W/prepared" "${LAYERS[@]}" --no-progress)
made_or_given extract-fp32-cpu "$GIVEN_STORE" "$W/fp32" 300 "${DS[@]}" "${EXTRACT[@]}" --store "$W/fp32" --device cpu \
  --dtype float32
step "extract-bf16-$DEV" 300 "${DS[@]}" "${EXTRACT[@]}" --store "$W/bf16" --device "$DEV" --dtype bfloat16
step compare-bf16 120 "${LIB[@]}" compare "$W/fp32" "$W/bf16" --bound "$BF16_BOUND"

# vLLM in bf16: the side-stream device->host copy into pinned staging, with either model runner.
for runner in v2 v1; do
  if [ "$DRY" = 1 ]; then
    skip "vllm-$runner" "needs vLLM 0.33 on CUDA"
    continue
  fi
  step "extract-vllm-$runner" 600 env VLLM_USE_V2_MODEL_RUNNER=$([ $runner = v2 ] && echo 1 || echo 0) \
    "${VDS[@]}" "${EXTRACT[@]}" --engine vllm --store "$W/vllm-$runner" --dtype bfloat16
  step "compare-vllm-$runner" 120 "${LIB[@]}" compare "$W/fp32" "$W/vllm-$runner" --bound "$BF16_BOUND"
done

LAUNCH=(.venv-vllm/bin/python scripts/launch_vllm.py "$W/tiny" --hidden-states-backend zarr --data "$W/prepared"
        "${LAYERS[@]}")
VLLM_FLAGS=(--port "$PORT" --dtype bfloat16 --gpu-memory-utilization "$GPU_MEM")
if [ "$TP" -ge 2 ]; then  # TP=2 through the launcher: rank 0 alone writes, every request still finishes
  serve vllm-tp2 "${LAUNCH[@]}" --store "$W/vllm-tp2" -- "${VLLM_FLAGS[@]}" --tensor-parallel-size 2 \
    && step vllm-tp2-requests 120 "${LIB[@]}" send "$URL" "$W/prepared" 0 1 2 3
  unserve
  step vllm-tp2-verify 120 "${DS[@]}" store verify "$W/vllm-tp2" --no-progress
  step compare-vllm-tp2 120 "${LIB[@]}" compare "$W/fp32" "$W/vllm-tp2" --bound "$BF16_BOUND" --subset
elif [ "$DRY" = 1 ]; then
  skip vllm-tp2 "needs 2 GPUs and vLLM 0.33"
fi

# The abort probe: a small token budget per step stretches the longest prompt's prefill over many steps.
aborted() {
  trap '[ -z "$SERVER" ] || unserve' EXIT  # again: side by side, this chain is a subshell, which drops traps
  if [ "$DRY" = 1 ]; then
    serve abort-server "${DS[@]}" serve --model "$W/tiny" --data "$W/prepared" --to zarr --store "$W/abort" \
      "${LAYERS[@]}" --port "$PORT"
  else
    serve abort-server "${LAUNCH[@]}" --store "$W/abort" -- "${VLLM_FLAGS[@]}" --max-num-batched-tokens 32 \
      --max-num-seqs 4
  fi && step abort-probe 180 "${LIB[@]}" abort-probe "$URL" "$W/prepared" "$W/aborted-id"
  unserve
  step abort-verify 120 "${DS[@]}" store verify "$W/abort" --no-progress
  step abort-absent-or-whole 60 "${LIB[@]}" absent-or-whole "$W/abort" "$W/fp32" "$W/aborted-id" --bound "$BF16_BOUND"
}
# A drafter in DSpark's layout (the default), served with `method: dspark`; then the verifier alone.
drafted() {
  # shellcheck disable=SC2046  # --max-steps N or nothing
  made_or_given train "$GIVEN_RUN" "$W/run" 900 "${DS[@]}" train --config scripts/configs/demo.yaml --from zarr \
    --store "$W/fp32" --data-path "$W/prepared" --verifier-name-or-path "$W/tiny" --save-path "$W/run" --device "$DEV" \
    --no-progress $([ "$STEPS" = 0 ] || echo --max-steps "$STEPS")
  step export 120 "${DS[@]}" export "$W/run/latest" --output "$W/export" --verifier-name dspark/tiny-verifier
  BENCH=(bench --endpoint "$URL" --prompts demo="$CHAT" --max-prompts "$PROMPTS" --max-tokens "$TOKENS" --ignore-eos
         --concurrency 4 --no-progress)
  if [ "$DRY" = 1 ]; then
    skip serve-draft "method dspark runs on Model Runner V2, GPU only"
  else
    for served in drafted alone; do
      if [ $served = drafted ]; then what=(--drafter "$W/export"); else what=(--method none); fi
      serve "serve-$served" "${VDS[@]}" serve-draft --verifier "$W/tiny" "${what[@]}" --port "$PORT" --dtype bfloat16 \
        -- --gpu-memory-utilization "$GPU_MEM" \
        && step "bench-$served" 600 "${DS[@]}" "${BENCH[@]}" --output "$W/bench-$served"
      unserve
    done
  fi
  step eval-decode 600 "${DS[@]}" eval --checkpoint "$W/run/latest" --device "$DEV" --decode --prompts demo="$CHAT" \
    --max-prompts "$PROMPTS" --max-new-tokens "$TOKENS" --ignore-eos --no-progress --output "$W/decoded" \
    "${EVAL_SIZES[@]}"
  [ "$DRY" = 1 ] || step acceptance 60 "${LIB[@]}" acceptance "$W/bench-drafted" "$W/bench-alone" "$W/decoded"
}
# One after the other; a dry run, whose drafter serves nothing, runs them side by side (side_by_side).
side_by_side aborted drafted
finish
