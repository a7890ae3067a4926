# Sourced by the Slurm recipes (run.sbatch, extract.sbatch, train.sbatch): every knob, with the
# seed's value as its default, and the helpers that start, watch and stop the job's steps.
# Override any of them in the environment of `sbatch` (Slurm exports it by default), e.g.
#   MODEL=/shared/models/Verifier DATA_PATH=/shared/prepared/chat sbatch scripts/slurm/run.sbatch

: "${DSPARK_HOME:=${SLURM_SUBMIT_DIR:-$PWD}}"   # a dspark checkout on shared storage (its venvs too)
: "${VENV:=$DSPARK_HOME/.venv}"                 # training environment (bash scripts/setup.sh)
: "${EXTRACT_VENV:=$DSPARK_HOME/.venv-vllm}"     # extraction environment (bash scripts/setup.sh --vllm)
: "${MODEL:?set MODEL to the verifier (a folder on shared storage, or a hub name)}"
: "${DATA_PATH:?set DATA_PATH to the folder dspark prepare wrote (on shared storage)}"
: "${WORK:=$DSPARK_HOME/cache/slurm}"           # shared storage for everything the job writes
: "${SAVE_PATH:=$WORK/run}"                     # the run folder (resumed when it exists)
: "${CACHE:=$WORK/cache}"                       # live mode: the trainer's Zarr cache
: "${STORE:=$WORK/store}"                       # offline mode: the Zarr store
: "${TARGET_LAYER_IDS:=24 48 72 88 92}"

# Extraction: live, one vLLM server with TP $EXTRACT_TP over $EXTRACT_NODES nodes (the seed's TP8
# pair; rank 1 runs --headless); offline, one vLLM engine with TP $EXTRACT_TP on each node.
# (Not VLLM_*: vLLM reads that prefix itself, and VLLM_PORT means something else to it.)
: "${EXTRACT_NODES:=2}"
: "${EXTRACT_TP:=8}"
: "${EXTRACT_PORT:=8000}"
: "${EXTRACT_MASTER_PORT:=29501}"               # vLLM's own rendezvous between the pair
: "${EXTRACT_ARGS:=}"                           # more `vllm serve` flags, e.g. --max-model-len 8192
: "${HEALTH_TIMEOUT:=1800}"

# Mooncake: the master runs on the training node.
: "${MOONCAKE_PORT:=50051}"
: "${MOONCAKE_METRICS_PORT:=9003}"
: "${MOONCAKE_PROTOCOL:=tcp}"                   # rdma on InfiniBand/RoCE, with MOONCAKE_DEVICE
: "${MOONCAKE_DEVICE:=}"
: "${MOONCAKE_METADATA_SERVER:=P2PHANDSHAKE}"
: "${MOONCAKE_GLOBAL_SEGMENT_GIB:=32}"          # mounted by the extractor: the objects live there
: "${MOONCAKE_LOCAL_BUFFER_GIB:=4}"
: "${MOONCAKE_WRITER_THREADS:=4}"
: "${TRAIN_SEGMENT_GIB:=1}"                     # mounted by the trainer

# Training: torchrun on one node, the seed's train.py flags.
: "${TRAIN_NPROC:=8}"
: "${EPOCHS:=2}"
: "${LR:=1e-3}"
: "${TOTAL_SEQ_LEN:=1024}"
# Experiment trackers: jsonl (always on), tensorboard, mlflow, wandb, trackio (comma-separated);
# offline in the run folder by default (trackio: TRACKIO_DIR), see `dspark train --help`.
: "${LOGGER:=jsonl}"
[ -n "${LOSS_FN:-}" ] || LOSS_FN='{"ce":0.1,"tv":0.9}'
: "${TRAIN_ARGS:=--speculator-type dspark --block-size 8 --max-anchors 64 --dflash-decay-gamma 4.0 --markov-rank 32 --markov-head-type vanilla --enable-confidence-head --confidence-head-with-markov --confidence-head-alpha 1.0 --optimizer muon --scheduler-type cosine --scheduler-warmup-ratio 0.03 --checkpoint-freq 0.5 --train-data-ratio 0.9 --log-freq 10 --seed 0}"
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

# wait_for WHAT PID SECONDS TEST...: until TEST succeeds; fail if the step PID dies or time runs out.
wait_for() {
  local what=$1 pid=$2 timeout=$3; shift 3
  local deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    alive "$pid" || { say "error: $what exited before it was ready; read its log in $LOGS"; return 1; }
    ((SECONDS < deadline)) || { say "error: $what not ready after ${timeout}s; read its log in $LOGS"; return 1; }
    sleep 2
  done
  say "$what ready"
}

tcp_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }
http_ok() { curl -sf --noproxy '*' -o /dev/null "$1"; }

# The trainer's command: torchrun on one node, the seed's train.py flags ($TRAIN_ARGS split on spaces).
LAYERS=${TARGET_LAYER_IDS// /,}
# shellcheck disable=SC2206
TRAIN_CMD=("$VENV/bin/torchrun" --standalone --nnodes 1 --nproc-per-node "$TRAIN_NPROC" "$VENV/bin/dspark" train
           --verifier-name-or-path "$MODEL" --data-path "$DATA_PATH" --save-path "$SAVE_PATH"
           --target-layer-ids "$LAYERS" --epochs "$EPOCHS" --lr "$LR" --total-seq-len "$TOTAL_SEQ_LEN"
           --loss-fn "$LOSS_FN" --logger "$LOGGER" $TRAIN_ARGS)
