#!/usr/bin/env bash
# The trainer side on a CUDA machine with its own torch and Triton (a lent H100/H200, or any GPU
# host): what CPU CI cannot run. Steps: toy verifier; transformers extraction, CUDA bf16 against
# CPU fp32; `dspark train` on CUDA (flex attention, the fused Triton losses, torch.compile, Muon:
# finite metrics, recompiles counted); `dspark eval` on CUDA; `train --autocast off`; one-rank
# NCCL DDP under torchrun; resume equality (N steps at once vs N/2, then resumed to N).
# Each step runs under its own timeout, all within BUDGET seconds (9 minutes); a failed step is
# recorded and the next one runs. Writes summary.txt, failures.txt and logs.tar.gz to $OUT (the
# device tool sets it; default cache/gpu-check-device). Exit status 1 if any step failed.
#
# On a lent machine, whose image lacks speculators, zarr, pydantic, dspark and a few more:
#   bash scripts/gpu_wheels.sh                        # here: .gpuwheels/, ignored, under 64 MiB
#   run  command: bash scripts/gpu_check_device.sh    carry: [".gpuwheels"]   timeout_s: 600
# --dry-run (or DSPARK_GPU_CHECK_DRY=1): every step on the CPU with tiny sizes, NCCL as gloo, eval and
# train --autocast off beside the torchrun steps (DSPARK_GPU_CHECK_JOBS=1: one step at a time); what CI
# runs (tests/test_gpu_check.py), which checks the plumbing and so gives it its test session's inputs.
# Inputs given instead of built (unset, as on a real run: built here). Each is linked into the work
# folder, read and never written, and its step passes at once, saying `given: PATH`:
#   DSPARK_GPU_CHECK_VERIFIER  a toy verifier folder (skips toy-verifier)
#   DSPARK_GPU_CHECK_PREPARED  data prepared for it by `dspark prepare` (skips prepare; needs the verifier)
#   DSPARK_GPU_CHECK_STORE     a Zarr store of that data's fp32 CPU states at layers 1 3 5 (skips
#                              extract-fp32-cpu; needs the data)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${DSPARK_GPU_CHECK_DRY:-0}
[ "${1:-}" != --dry-run ] || DRY=1
GIVEN_VERIFIER=${DSPARK_GPU_CHECK_VERIFIER:-} GIVEN_PREPARED=${DSPARK_GPU_CHECK_PREPARED:-}
GIVEN_STORE=${DSPARK_GPU_CHECK_STORE:-}
if { [ -n "$GIVEN_STORE" ] && [ -z "$GIVEN_PREPARED" ]; } || { [ -n "$GIVEN_PREPARED" ] && [ -z "$GIVEN_VERIFIER" ]; }
then
  echo "DSPARK_GPU_CHECK_STORE needs DSPARK_GPU_CHECK_PREPARED, which needs DSPARK_GPU_CHECK_VERIFIER" >&2
  exit 2
fi
: "${OUT:=cache/gpu-check-device}"
: "${BUDGET:=540}"
# shellcheck source=scripts/gpu_check_common.sh
. scripts/gpu_check_common.sh
export TORCH_LOGS=recompiles  # torch says each recompilation: train-ok counts them

if [ "$DRY" = 1 ]; then
  PY=${PYTHON:-.venv/bin/python}
  DEV=cpu TOY_STEPS=1 CHATS=40 SEQ=512 STEPS=2 TRUN=(--cpu) RESUME_TOL=0  # CPU training resumes bitwise
else
  PY=${PYTHON:-python3}
  # CUDA backwards sum with atomic adds in any order (embedding, flex attention): the last bits may differ.
  DEV=cuda TOY_STEPS=60 CHATS=400 SEQ=1024 STEPS=20 TRUN=() RESUME_TOL=1e-3
  if [ -d .gpuwheels ]; then  # the machine's torch, Triton and transformers; the rest from the wheels
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" \
      .gpuwheels/*.whl >"$LOGS/wheels.log" 2>&1 || { cat "$LOGS/wheels.log"; exit 1; }
    export PYTHONPATH=$W/site${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
DS=("$PY" -m dspark.cli)
LIB=("$PY" scripts/gpu_check_lib.py)
TRAIN=(train --config scripts/configs/demo.yaml --from zarr --store "$W/fp32" --data-path "$W/prepared"
       --verifier-name-or-path "$W/tiny" --device "$DEV" --total-seq-len "$SEQ" --log-freq 2 --no-progress)
echo "gpu check ($([ "$DRY" = 1 ] && echo 'dry run, CPU' || echo "$DEV")): work folder $W, budget ${BUDGET}s"
[ "$DRY" = 1 ] || "$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' \
  | tee "$LOGS/device.txt"

made_or_given toy-verifier "$GIVEN_VERIFIER" "$W/tiny" 120 "${DS[@]}" toy-verifier --output "$W/tiny" \
  --steps "$TOY_STEPS"
head -n "$CHATS" "$("$PY" -c 'from dspark.verifier.toy import demo_chat_path; print(demo_chat_path())')" >"$W/chat.jsonl"
made_or_given prepare "$GIVEN_PREPARED" "$W/prepared" 60 "${DS[@]}" prepare --model "$W/tiny" --data "$W/chat.jsonl" \
  --output "$W/prepared" --seq-length 512 --minimum-valid-tokens 16
for x in "cpu float32 fp32 $GIVEN_STORE" "$DEV bfloat16 bf16"; do
  read -r dev dtype name given <<<"$x"
  made_or_given "extract-$name-$dev" "$given" "$W/$name" 90 "${DS[@]}" extract --to zarr --model "$W/tiny" \
    --data "$W/prepared" --store "$W/$name" --target-layer-ids 1 3 5 --device "$dev" --dtype "$dtype" --no-progress
done
step compare-bf16 60 "${LIB[@]}" compare "$W/fp32" "$W/bf16" --bound "$BF16_BOUND"

# flex attention, fused losses, torch.compile and Muon are what `dspark train` picks on CUDA.
step train 180 "${DS[@]}" "${TRAIN[@]}" --save-path "$W/run" --max-steps "$STEPS"
step train-metrics 30 "${LIB[@]}" train-ok "$W/run" --log "$LOGS/train.log"
# Two chains that a dry run runs side by side (side_by_side): no bits of theirs are compared.
evaluated_and_autocast_off() {
  step eval 90 "${DS[@]}" eval --checkpoint "$W/run/latest" --device "$DEV" --max-anchors 256 --no-progress
  step train-autocast-off 150 "${DS[@]}" "${TRAIN[@]}" --save-path "$W/run-fp32" --max-steps "$STEPS" --autocast off
  step train-autocast-off-metrics 30 "${LIB[@]}" train-ok "$W/run-fp32" --log "$LOGS/train-autocast-off.log"
}
distributed() {
  step ddp-nccl 60 "$PY" -m torch.distributed.run --nproc-per-node 1 scripts/gpu_check_lib.py ddp-smoke "${TRUN[@]}"
  step train-torchrun 150 "$PY" -m torch.distributed.run --nproc-per-node 1 -m dspark.cli "${TRAIN[@]}" \
    --save-path "$W/run-torchrun" --max-steps "$STEPS"
}
side_by_side evaluated_and_autocast_off distributed
# Resume equality against the first run: half its steps, then a second process resumes to the end.
step resume-half 120 "${DS[@]}" "${TRAIN[@]}" --save-path "$W/run-resumed" --max-steps $(( STEPS / 2 ))
step resume-rest 120 "${DS[@]}" "${TRAIN[@]}" --save-path "$W/run-resumed" --max-steps "$STEPS"
step resume-equal 30 "${LIB[@]}" same-weights "$W/run" "$W/run-resumed" --rel-tol "$RESUME_TOL"

finish
