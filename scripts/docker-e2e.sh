#!/usr/bin/env bash
# The containers end to end on this machine (CI runs it after the unit tests): installs Docker
# where missing (Debian's docker.io + the compose v2 plugin), builds both images (reusing the
# wheelhouse, the base and the package layers between runs: scripts/docker-build.sh), then
# scripts/docker_e2e.py runs `docker compose up -d` (killing the trainer), `up -d` again with the
# offline profile beside it (resuming the trainer), and `up` once more, checking each through the
# docker SDK. Prints Docker's install, build and end-to-end wall times and the image sizes.
#   bash scripts/docker-e2e.sh --build     # Docker and the images only (CI runs it beside the Slurm
#                                          # check; the end to end after it finds them up to date)
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
if ! { docker info >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; }; then
  bash scripts/docker-build.sh --install-docker
  echo "[docker-e2e] Docker installed in $((SECONDS - t0))s"
fi
t1=$SECONDS
bash scripts/docker-build.sh
echo "[docker-e2e] images built in $((SECONDS - t1))s"
[ "${1:-}" != --build ] || exit 0
t2=$SECONDS
.venv/bin/python scripts/docker_e2e.py
echo "[docker-e2e] end to end in $((SECONDS - t2))s; all in $((SECONDS - t0))s"
