# Sourced by scripts/gpu_check_device.sh and scripts/gpu_check.sh: their work folder, the step runner
# and the summary. Before sourcing: DRY (1 for a dry run), BUDGET (seconds), OUT (the results folder);
# optionally MIN_STEP (seconds, default 5): a step left less than this of BUDGET is skipped, not started.
# DSPARK_GPU_CHECK_JOBS=1 makes a dry run run its steps one at a time, as a real run does (side_by_side).
W=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
LOGS=$W/logs SUMMARY=$OUT/summary.txt FAILURES=$OUT/failures.txt
mkdir -p "$LOGS" "$OUT"
: >"$SUMMARY"
: >"$FAILURES"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
BF16_BOUND=2e-2  # bf16 weights and activations against fp32: ~3e-3 per op, compounded over the layers
: "${MIN_STEP:=5}"

# step NAME SECONDS COMMAND...: run COMMAND under a timeout (at most what is left of BUDGET), log it
# to LOGS/NAME.log, and record the outcome in SUMMARY (and FAILURES with the log's tail).
step() {
  local name=$1 limit=$2 t0=$SECONDS rc last; shift 2
  (( limit <= BUDGET - SECONDS )) || limit=$(( BUDGET - SECONDS ))
  if (( limit < MIN_STEP )); then
    skip "$name" "the ${BUDGET}s budget is spent"
    return 1
  fi
  timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  last=$(grep '[[:alnum:]]' "$LOGS/$name.log" | tail -n 1 | cut -c1-240)
  (( rc != 124 && rc != 137 )) || last="timed out after ${limit}s"
  if (( rc == 0 )); then
    echo "ok   $name ($((SECONDS - t0))s) $last" | tee -a "$SUMMARY"
  else
    echo "FAIL $name ($((SECONDS - t0))s, exit $rc) $last" | tee -a "$SUMMARY"
    { echo "== $name: exit $rc"; tail -n 40 "$LOGS/$name.log"; echo; } >>"$FAILURES"
  fi
  return "$rc"
}

# made_or_given NAME GIVEN OUTPUT TIMEOUT CMD...: step NAME runs CMD (under TIMEOUT) to make OUTPUT, or, when
# GIVEN names a folder given to this run, takes it as OUTPUT (a link, never written) and says `given: GIVEN`.
made_or_given() {
  local name=$1 given=$2 output=$3
  shift 3
  if [ -z "$given" ]; then
    step "$name" "$@"
    return
  fi
  local link='[ -d "$1" ] || { echo "not a folder: $1"; exit 1; }; ln -s "$(realpath "$1")" "$2" && echo "given: $1"'
  step "$name" 10 bash -c "$link" _ "$given" "$output"
}

# side_by_side CHAIN...: run each CHAIN, a shell function that runs steps one after another: in CHAIN order, or
# in a dry run all at once (DSPARK_GPU_CHECK_JOBS=1: in order there too), where a step mostly waits on one core
# while a fresh process imports torch. SUMMARY and FAILURES list the chains' steps in CHAIN order either way.
# Chains side by side share no output and no port, and none trains a run whose bits are compared: on the CPU a
# training beside another process has come out not bitwise equal to the same training alone.
side_by_side() {
  local chain i=0
  if [ "$DRY" != 1 ] || [ "${DSPARK_GPU_CHECK_JOBS:-2}" = 1 ]; then
    for chain; do "$chain"; done
    return
  fi
  for chain; do
    (SUMMARY=$W/summary.$i FAILURES=$W/failures.$i; : >"$SUMMARY"; : >"$FAILURES"; "$chain") &
    i=$((i + 1))
  done
  wait
  for (( i = 0; i < $#; i++ )); do
    cat "$W/summary.$i" >>"$SUMMARY"
    cat "$W/failures.$i" >>"$FAILURES"
  done
}

# skip NAME WHY: a step not run. A dry run's skips (CUDA, vLLM 0.33) are expected; others are failures.
skip() {
  if [ "$DRY" = 1 ]; then
    echo "dry  $1: $2" | tee -a "$SUMMARY"
  else
    echo "skip $1: $2" | tee -a "$SUMMARY" "$FAILURES"
  fi
}

# finish: the logs (and each run's metrics and eval reports) as OUT/logs.tar.gz, a last line, and
# the exit status: 1 if any step failed or was skipped for want of time.
finish() {
  local failed
  (cd "$W" && find . -path ./logs -prune -o \( -name metrics.jsonl -o -name eval.json -o -name bench.json \) -print \
    | tar -czf - logs -T -) >"$OUT/logs.tar.gz"
  failed=$(grep -c '^\(FAIL\|skip\)' "$SUMMARY")
  echo "$failed failed of $(wc -l <"$SUMMARY") steps in ${SECONDS}s; $OUT: summary.txt, failures.txt, logs.tar.gz"
  [ "${DSPARK_GPU_CHECK_KEEP:-0}" = 1 ] || rm -rf "$W"
  [ "$failed" = 0 ]
}
