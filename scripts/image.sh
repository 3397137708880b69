#!/usr/bin/env bash
# `make image`: build docker/Dockerfile as `docker build -f docker/Dockerfile -t hvd_gqsgd .`
# would, with buildah (no Docker engine here), then run the image's job inside it: its CMD
# (horovodrun --check-build and the usage hint) and the demo, 2 ranks of fp32 vs GlobalQSGD.
# docker/README.md says what this checks, what differs from Docker, and how long it takes.
#
#   IMAGE_STORE  where buildah keeps everything: images, cache mounts, logs
#                (default /var/tmp/hvd_gqsgd-image; `make image-clean` removes it)
#   IMAGE_DEMO   the command the demo runs in the container (the Makefile passes it)
#   BASE_IMAGE   the Dockerfile's base; unset: its own default, or a Debian stand-in where
#                that cannot be pulled
#   IMAGE_TAG    default hvd_gqsgd
#
# Root only: buildah's chroot isolation and mmdebstrap need it.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DOCKERFILE=$ROOT/docker/Dockerfile
STORE=${IMAGE_STORE:-/var/tmp/hvd_gqsgd-image}
TAG=${IMAGE_TAG:-hvd_gqsgd}
DEMO=${IMAGE_DEMO:-horovodrun -np 2 -H localhost:2 --gloo python examples/torch_digits.py}
STANDIN=localhost/hvd_gqsgd-base:bookworm-debian
RUN_NAME=hvd_gqsgd-run
# buildah puts its temporary files and the Dockerfile's RUN --mount=type=cache directories
# under TMPDIR (buildah-cache/); keep them in the store too.
export TMPDIR=$STORE/tmp
B=(buildah --root "$STORE/storage" --runroot "$STORE/run" --storage-driver vfs)

log() { printf '[image] %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

need_tools() {
  [ "$(id -u)" = 0 ] || die "run as root: buildah's chroot isolation and mmdebstrap need it"
  if ! command -v buildah >/dev/null || ! command -v mmdebstrap >/dev/null; then
    log "installing buildah and mmdebstrap from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah mmdebstrap >/dev/null
  fi
}

# Docker's name resolution: python:3.11 is docker.io/library/python:3.11.
qualify() {
  local name=$1 first=${1%%/*}
  if [[ $name != */* ]]; then
    name=library/$name
    first=library
  fi
  if [[ $first != *.* && $first != *:* && $first != localhost ]]; then
    name=docker.io/$name
  fi
  printf '%s\n' "$name"
}

have_image() { "${B[@]}" inspect --type image "$1" >/dev/null 2>&1; }

# The rest of the host's apt sources, for mmdebstrap: what apt itself reads.
host_apt_lists() {
  find /etc/apt/sources.list /etc/apt/sources.list.d -maxdepth 1 -type f \
    \( -name '*.list' -o -name '*.sources' \) 2>/dev/null | sort
}

# Debian bookworm's own python3 (3.11.2) where python:3.11-slim-bookworm cannot be had.
make_standin() {
  local tar=$TMPDIR/standin-bookworm.tar ctr
  mapfile -t lists < <(host_apt_lists)
  [ "${#lists[@]}" -gt 0 ] || die "no apt sources on this machine for mmdebstrap"
  log "making the stand-in base $STANDIN with mmdebstrap (about a minute)"
  mmdebstrap --quiet --variant=minbase \
    --include=python3,python3-venv,python3-pip,python3-dev,ca-certificates \
    bookworm "$tar" "${lists[@]}"
  ctr=$("${B[@]}" from scratch)
  "${B[@]}" add "$ctr" "$tar" / >/dev/null
  # The official image's environment, less its Python build's own variables.
  "${B[@]}" config --env LANG=C.UTF-8 \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd python3 --label "org.opencontainers.image.description=hvd_gqsgd stand-in for $1" \
    "$ctr"
  "${B[@]}" commit --quiet --rm "$ctr" "$STANDIN" >/dev/null
  rm -f "$tar"
}

# Sets BASE_REF, the image the build's FROM gets, and BASE_S, the seconds spent making it.
pick_base() {
  BASE_S=0
  local default
  default=$(sed -n 's/^ARG BASE_IMAGE=//p' "$DOCKERFILE")
  [ -n "$default" ] || die "$DOCKERFILE has no ARG BASE_IMAGE=<default>"
  BASE_REF=$(qualify "${BASE_IMAGE:-$default}")
  if have_image "$BASE_REF"; then
    log "base: $BASE_REF (already in the store)"
  elif "${B[@]}" pull --quiet "$BASE_REF" >/dev/null; then
    log "base: $BASE_REF (pulled)"
  elif [ -n "${BASE_IMAGE:-}" ]; then
    die "cannot pull BASE_IMAGE=$BASE_IMAGE (above); unset it to use the Debian stand-in"
  else
    log "cannot pull $BASE_REF (above): building on a Debian stand-in instead," \
      "see docker/README.md for what differs"
    local start=$SECONDS
    have_image "$STANDIN" || make_standin "$BASE_REF"
    BASE_S=$((SECONDS - start))
    BASE_REF=$STANDIN
    log "base: $STANDIN"
  fi
}

build() {
  local sources=$STORE/sources buildlog=$STORE/logs/build.log start=$SECONDS
  mkdir -p "$sources" "$STORE/logs"
  # Through a file: a failure inside <(...) would not stop the script.
  python3 "$ROOT/scripts/host_sources.py" "$sources" >"$sources/volumes"
  mapfile -t VOLUMES <"$sources/volumes"
  log "package sources given to the build (read-only): ${VOLUMES[*]}"
  local args=()
  for v in "${VOLUMES[@]}"; do args+=(--volume "$v"); done
  # TORCH_INDEX= : no index beyond the host's pip settings (the default is PyTorch's, which
  # this machine does not reach).  No --layers: every build runs every RUN line, as a first
  # `docker build` does, while the RUN's cache mount keeps pip's cache and Horovod's wheel.
  # A failed build's container is removed by cleanup (buildah's --force-rm needs --layers).
  "${B[@]}" build --isolation chroot --pull=never \
    --build-arg "BASE_IMAGE=$BASE_REF" --build-arg TORCH_INDEX= "${args[@]}" \
    -f "$DOCKERFILE" -t "$TAG" "$ROOT" 2>&1 | tee "$buildlog"
  BUILD_S=$((SECONDS - start))
  # The image this build replaced keeps its ~5 GB (vfs copies every layer) until pruned.
  "${B[@]}" rmi --prune >/dev/null
  if grep -q 'using cached Horovod wheel' "$buildlog"; then
    WHEEL="reused from the build cache"
  elif grep -q 'building Horovod' "$buildlog"; then
    WHEEL="compiled from the sdist"
  else
    die "the build log ($buildlog) says neither how Horovod was installed"
  fi
}

# buildah (1.28) leaves in the image an empty file or directory at each --volume target the
# base did not have, where `docker build` leaves nothing.  Check that they are empty, so that
# nothing of the host's sources stays in the image, and list them (in LEFT).  $1: a fresh
# container of the image (on vfs each container is a full copy, so the run's is reused).
check_mount_points() {
  local img_ctr=$1 base_ctr base img target
  base_ctr=$("${B[@]}" from --pull=false --name hvd_gqsgd-base-check "$BASE_REF")
  base=$("${B[@]}" mount "$base_ctr")
  img=$("${B[@]}" mount "$img_ctr")
  LEFT=()
  for v in "${VOLUMES[@]}"; do
    target=${v#*:}
    target=${target%:ro}
    [ ! -e "$base$target" ] || continue
    if [ -d "$img$target" ] && [ -n "$(ls -A "$img$target")" ] ||
      { [ -f "$img$target" ] && [ -s "$img$target" ]; }; then
      die "the build left host content in the image at $target"
    fi
    [ ! -e "$img$target" ] || LEFT+=("$target")
  done
  "${B[@]}" umount "$base_ctr" "$img_ctr" >/dev/null
  "${B[@]}" rm "$base_ctr" >/dev/null
}

cleanup() {
  # Only this store's containers: the run's, and any a killed build left.
  "${B[@]}" rm --all >/dev/null || log "could not remove the containers in $STORE/storage"
}

# TensorFlow's C++ logger ignores TF_CPP_MIN_LOG_LEVEL for its first lines; horovodrun prefixes
# rank 0's lines with [0]<stdout>: (as in `make demo`).  grep's status 1 only says that every
# line was noise.
tidy() {
  { grep -v -e '^I0000 ' -e 'absl::InitializeLog' -e 'cuda drivers' || [ $? = 1 ]; } |
    sed -e 's/^\[0\]<stdout>://'
}

run_job() {
  local ctr start cmd=() demo=()
  "${B[@]}" inspect --type image "$TAG" >"$STORE/logs/image.json"
  mapfile -d '' -t cmd < <(python3 -c 'import json, sys
print("\0".join(json.load(open(sys.argv[1]))["OCIv1"]["config"]["Cmd"]), end="\0")' \
    "$STORE/logs/image.json")
  [ "${#cmd[@]}" -gt 0 ] || die "$TAG has no CMD"
  read -ra demo <<<"$DEMO"
  # docker run gives a container a hostname that /etc/hosts resolves; buildah run's hostname
  # does not resolve unless asked, and then Gloo's hvd.init() dies of a segfault (seen here).
  ctr=$("${B[@]}" from --pull=false --name "$RUN_NAME" --add-host "$RUN_NAME:127.0.0.1" "$TAG")
  check_mount_points "$ctr"
  start=$SECONDS
  log "CMD, in the container: ${cmd[*]}"
  "${B[@]}" run --isolation chroot --hostname "$RUN_NAME" "$ctr" -- "${cmd[@]}" 2>&1 | tidy
  CMD_S=$((SECONDS - start))
  start=$SECONDS
  log "demo, in the container: ${demo[*]}"
  "${B[@]}" run --isolation chroot --hostname "$RUN_NAME" "$ctr" -- "${demo[@]}" 2>&1 | tidy
  DEMO_S=$((SECONDS - start))
}

main() {
  need_tools
  mkdir -p "$TMPDIR"
  trap cleanup EXIT
  cleanup
  pick_base
  build
  run_job
  cleanup
  trap - EXIT
  [ -z "$("${B[@]}" containers --quiet)" ] || die "containers are left in $STORE/storage"
  log "times: base ${BASE_S}s, build ${BUILD_S}s (Horovod wheel ${WHEEL}), CMD ${CMD_S}s," \
    "demo ${DEMO_S}s"
  [ "${#LEFT[@]}" = 0 ] ||
    log "empty mount points the build's --volume left in the image: ${LEFT[*]}"
  log "store: $STORE ($(du -sh "$STORE" | cut -f1)); images:"
  "${B[@]}" images >&2
}

# Sourced by tests/test_image.py for its functions; run, it does the job.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  main "$@"
fi
