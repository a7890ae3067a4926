# Sourced by the Slurm recipes (run.sbatch, extract.sbatch, train.sbatch): where each step runs,
# and the helpers that start, watch and stop the steps. What the steps compute comes from the
# deployment file DSPARK_CONFIG (configs/gpu.yaml: the seed's values), which every command reads
# with --config. Override any knob in the environment of `sbatch` (Slurm exports it), e.g.
#   MODEL=/shared/models/Verifier DATA_PATH=/shared/prepared/chat sbatch scripts/slurm/run.sbatch

: "${DSPARK_HOME:=${SLURM_SUBMIT_DIR:-$PWD}}"   # a dspark checkout on shared storage (its venvs too)
: "${DSPARK_CONFIG:=$DSPARK_HOME/configs/gpu.yaml}"
: "${VENV:=$DSPARK_HOME/.venv}"                 # training environment (bash scripts/setup.sh)
: "${EXTRACT_VENV:=$DSPARK_HOME/.venv-vllm}"     # extraction environment (bash scripts/setup.sh --vllm)
: "${MODEL:?set MODEL to the verifier (a folder on shared storage, or a hub name)}"
: "${DATA_PATH:?set DATA_PATH to the folder dspark prepare wrote (on shared storage)}"
: "${WORK:=$DSPARK_HOME/cache/slurm}"           # shared storage for everything the job writes
: "${SAVE_PATH:=$WORK/run}"                     # the run folder (resumed when it exists)
: "${CACHE:=$WORK/cache}"                       # live mode: the trainer's Zarr cache
: "${STORE:=$WORK/store}"                       # offline mode: the Zarr store

# Extraction: live, one vLLM server with TP $EXTRACT_TP over $EXTRACT_NODES nodes (the seed's TP8
# pair; rank 1 runs --headless); offline, one vLLM engine with TP $EXTRACT_TP on each node.
# (Not VLLM_*: vLLM reads that prefix itself, and VLLM_PORT means something else to it.)
: "${EXTRACT_NODES:=2}"
: "${EXTRACT_TP:=8}"
: "${EXTRACT_PORT:=8000}"
: "${EXTRACT_MASTER_PORT:=29501}"               # vLLM's own rendezvous between the pair
: "${HEALTH_TIMEOUT:=1800}"

# Mooncake: the master runs on the training node.
: "${MOONCAKE_PORT:=50051}"
: "${MOONCAKE_METRICS_PORT:=9003}"
: "${MOONCAKE_DEVICE:=}"                        # RDMA device(s), with `protocol: rdma` in the deployment file

: "${TRAIN_NPROC:=8}"                           # training: torchrun on one node
: "${STOP_GRACE:=60}"                           # seconds each server gets to stop before SIGKILL
# More srun flags per role, e.g. a container per step with pyxis:
#   EXTRACT_SRUN_ARGS="--container-image=dspark-extractor.sqsh --container-mounts=/shared:/shared"
: "${EXTRACT_SRUN_ARGS:=}"                      # the vLLM steps
: "${TRAIN_SRUN_ARGS:=}"                        # the Mooncake master and the trainer

NODES=($(scontrol show hostnames "${SLURM_JOB_NODELIST:?run this through sbatch}"))
LOGS=$SAVE_PATH/logs/${SLURM_JOB_ID}
mkdir -p "$LOGS"
STEPS=()   # "pid name" of every background step, stopped in reverse order on exit

say() { echo "[dspark $(date +%T)] $*" >&2; }

# start NAME NODE CMD...: one task on NODE, sharing the allocation with the other steps, logged
# to $LOGS/NAME.log, with the srun flags in $SRUN_ARGS. Slurm tracks every process it starts, so
# stopping the step leaves nothing behind.
start() {
  local name=$1 node=$2; shift 2
  # shellcheck disable=SC2086  # SRUN_ARGS is a list of flags
  srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap --kill-on-bad-exit=0 ${SRUN_ARGS:-} \
       --job-name="$name" --output="$LOGS/$name.log" --error="$LOGS/$name.log" "$@" &
  STEPS+=("$! $name")
  say "$name on $node (pid $!, log $LOGS/$name.log)"
}

alive() { kill -0 "$1" 2>/dev/null; }

# stop_all: SIGTERM each step (last started first), SIGKILL what outlives STOP_GRACE.
stop_all() {
  local i pid name t
  for ((i = ${#STEPS[@]} - 1; i >= 0; i--)); do
    read -r pid name <<<"${STEPS[i]}"
    alive "$pid" || continue
    say "stopping $name"
    kill -TERM "$pid" 2>/dev/null || true
    for ((t = 0; t < STOP_GRACE * 2; t++)); do alive "$pid" || break; sleep 0.5; done
    alive "$pid" && { say "$name did not stop in ${STOP_GRACE}s: killing it"; kill -KILL "$pid" 2>/dev/null || true; }
    wait "$pid" 2>/dev/null || true
  done
  STEPS=()
}

# wait_for WHAT PID SECONDS URL: until URL answers (http://, or tcp://HOST:PORT); fail if the step PID
# dies or time runs out.
wait_for() {
  "$VENV/bin/python" -m dspark.core.net wait "$4" --timeout "$3" --pid "$2" --name "$1" \
    || { say "error: read the log of $1 in $LOGS"; return 1; }
  say "$1 ready"
}

# The trainer's command: torchrun on one node.
TRAIN_CMD=("$VENV/bin/torchrun" --standalone --nnodes 1 --nproc-per-node "$TRAIN_NPROC" "$VENV/bin/dspark" train
           --config "$DSPARK_CONFIG" --verifier-name-or-path "$MODEL" --data-path "$DATA_PATH" --save-path "$SAVE_PATH")
