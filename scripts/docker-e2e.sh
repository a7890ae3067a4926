#!/usr/bin/env bash
# The containers end to end on this machine (CI runs it after the unit tests): installs Docker
# where missing (Debian's docker.io + the compose v2 plugin), builds both images (reusing the
# base, the wheelhouse and Docker's layer cache between runs), then scripts/docker_e2e.py runs
# `docker compose up` (killing and resuming the trainer), `up` again, and the offline profile,
# checking each through the docker SDK. Prints build and end-to-end wall times and image sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
docker info >/dev/null 2>&1 && docker compose version >/dev/null 2>&1 || bash scripts/docker-build.sh --install-docker
bash scripts/docker-build.sh
echo "[docker-e2e] images built in $((SECONDS - t0))s"
t1=$SECONDS
.venv/bin/python scripts/docker_e2e.py
echo "[docker-e2e] end to end in $((SECONDS - t1))s; all in $((SECONDS - t0))s"
