#!/usr/bin/env bash
# The offline variant: extract.sbatch, then train.sbatch once it succeeded (--dependency=afterok).
# Placement is environment variables (scripts/slurm/common.sh), the rest DSPARK_CONFIG; extra arguments go to both
# sbatch calls (e.g. --partition gpu). Prints the two job ids.
#   MODEL=... DATA_PATH=... bash scripts/slurm/offline.sh [sbatch flags]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export DSPARK_HOME=${DSPARK_HOME:-$(dirname "$(dirname "$here")")}
: "${MODEL:?set MODEL}" "${DATA_PATH:?set DATA_PATH}"
extract=$(sbatch --parsable "$@" "$here/extract.sbatch")
train=$(sbatch --parsable --dependency="afterok:$extract" --kill-on-invalid-dep=yes "$@" "$here/train.sbatch")
echo "extract job $extract, train job $train (runs after $extract succeeds)"
