#!/usr/bin/env bash
# Create or reuse the project virtualenv and make sure Horovod 0.28.1 (PyTorch + TensorFlow,
# MPI + Gloo) is built into it.  Used by `make test`, `make demo` and docker/Dockerfile, so the
# image and CI exercise the same steps.
#
# Horovod 0.28.1 (2023) does not build as released against torch 2.13 / TF 2.21; the three
# patches applied below are the measured minimum (see README "Building Horovod").  The built
# wheel is cached under $HVD_GQSGD_CACHE (default ~/.cache/hvd_gqsgd), keyed by every version
# that enters the ABI, so later runs skip the ~5 minute build.  With no cache the same command
# builds from the registry's sdist.
set -euo pipefail
BUILD_TMP=""

VENV=$(realpath -m "${VENV:-.venv}")
PYTHON=${PYTHON:-python3}
HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
TF_VERSION=2.21.0
CACHE_DIR=${HVD_GQSGD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_gqsgd}
EXTRAS=${EXTRAS:-dev}
# GPU mode (docker/Dockerfile.gpu): HOROVOD_GPU_OPERATIONS=NCCL builds Horovod's PyTorch binding
# with CUDA and NCCL; it needs a CUDA build of torch (pick its index with PIP_EXTRA_INDEX_URL).
# Horovod 0.28.1's TensorFlow GPU kernels call stream_executor::gpu::AsGpuStreamValue, which
# TF 2.21 no longer has, so a GPU build leaves the TensorFlow binding out.  Unset: CPU only.
GPU_OPS=${HOROVOD_GPU_OPERATIONS:-}

log() { printf '[setup] %s\n' "$*" >&2; }
# pip warns once per package about this machine's file:// index mirrors; keep real errors.
pip_quiet() { "$PY" -m pip "$@" 2> >(grep -v "^WARNING: Location '" >&2); }

ensure_mpi() {
  if command -v mpirun >/dev/null 2>&1 && command -v mpicxx >/dev/null 2>&1; then
    return
  fi
  if [ "$(id -u)" != 0 ]; then
    log "Open MPI is missing; install it as root: apt-get install libopenmpi-dev openmpi-bin"
    exit 1
  fi
  log "installing Open MPI from Debian"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    libopenmpi-dev openmpi-bin iproute2 >/dev/null
}

ensure_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  PY="$VENV/bin/python"
  # Frameworks first: Horovod's build links against whatever torch and TF are installed.
  if ! "$PY" -c "import torch, tensorflow" >/dev/null 2>&1; then
    log "installing torch $TORCH_VERSION and tensorflow-cpu $TF_VERSION"
    pip_quiet install -q "torch==$TORCH_VERSION" "tensorflow-cpu==$TF_VERSION" \
      "tf_keras==$TF_VERSION" setuptools wheel "cmake>=3.13,<4" packaging
  fi
}

wheel_key() {
  TF_CPP_MIN_LOG_LEVEL=3 "$PY" - "$HOROVOD_VERSION" <<'PYEOF'
import sys, platform, subprocess
import torch, tensorflow as tf
mpi = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
mpi = mpi.split()[-1] if mpi else "nompi"
py = "cp%d%d" % sys.version_info[:2]
print(f"horovod-{sys.argv[1]}-{py}-torch{torch.__version__}-tf{tf.__version__}"
      f"-ompi{mpi}-{platform.machine()}".replace("+", "_"))
PYEOF
}

horovod_ok() {
  local torch_built="h.mpi_built() and h.gloo_built()"
  [ -z "$GPU_OPS" ] || torch_built+=" and h.nccl_built()"
  # Each framework binding in its own process: importing both in one is the import-order trap.
  "$PY" -c "import horovod.torch as h; assert $torch_built" >/dev/null 2>&1 &&
  { [ -n "$GPU_OPS" ] ||
    TF_CPP_MIN_LOG_LEVEL=3 "$PY" -c "import horovod.tensorflow as h; assert h.mpi_built() and h.gloo_built()" \
      >/dev/null 2>&1; } &&
  "$PY" -c "import horovod; assert horovod.__version__ == '$HOROVOD_VERSION'" >/dev/null 2>&1
}

build_horovod() {
  local out=$1 src
  src=$(mktemp -d)
  BUILD_TMP=$src
  trap 'rm -rf "$BUILD_TMP"' EXIT
  log "building Horovod $HOROVOD_VERSION from sdist (takes ~5 min on 2 cores)"
  pip_quiet download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$src"
  tar -xzf "$src/horovod-$HOROVOD_VERSION.tar.gz" -C "$src"
  local dir="$src/horovod-$HOROVOD_VERSION"
  # torch >= 2.1 and TF >= 2.16 headers need C++17.
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$dir/CMakeLists.txt" "$dir/horovod/torch/CMakeLists.txt"
  # xla_mpi_ops.cc includes highwayhash headers that TF no longer ships; it is only needed
  # for XLA-compiled Horovod ops, which hvd_gqsgd does not use.
  sed -i '/xla_mpi_ops.cc/d' "$dir/horovod/tensorflow/CMakeLists.txt"
  local tf_binding=HOROVOD_WITH_TENSORFLOW=1
  [ -z "$GPU_OPS" ] || tf_binding=HOROVOD_WITHOUT_TENSORFLOW=1
  (
    cd "$dir"
    export HOROVOD_WITH_PYTORCH=1 "$tf_binding" HOROVOD_WITH_MPI=1 \
      HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=${HOROVOD_CPU_OPERATIONS:-MPI} \
      CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS="-j$(nproc)"
    export PATH="$VENV/bin:$PATH"
    pip_quiet wheel -q --no-build-isolation --no-deps . -w "$src/wheel"
  )
  mkdir -p "$(dirname "$out")"
  cp "$src"/wheel/horovod-*.whl "$out.tmp" && mv "$out.tmp" "$out"
}

check_gpu_mode() {
  [ -n "$GPU_OPS" ] || return 0
  if [ "$GPU_OPS" != NCCL ]; then
    log "HOROVOD_GPU_OPERATIONS=$GPU_OPS: only NCCL (or unset, for CPU only) is supported here"
    exit 1
  fi
  if ! "$PY" -c "import torch; assert torch.version.cuda" >/dev/null 2>&1; then
    log "HOROVOD_GPU_OPERATIONS=NCCL needs a CUDA build of torch, but $VENV has" \
      "$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null); install torch from a" \
      "CUDA index (PIP_EXTRA_INDEX_URL), or unset HOROVOD_GPU_OPERATIONS for a CPU build"
    exit 1
  fi
}

gpu_key() {
  # A GPU build is another wheel: key it by GPU ops and the CUDA toolkit it is compiled with.
  [ -n "$GPU_OPS" ] || return 0
  printf -- '-gpu%s-cuda%s' "$GPU_OPS" \
    "$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\),.*/\1/p')"
}

ensure_horovod() {
  if horovod_ok; then
    return
  fi
  check_gpu_mode
  local key whl
  key=$(wheel_key)$(gpu_key)
  whl="$CACHE_DIR/$key/horovod-$HOROVOD_VERSION-cp$("$PY" -c 'import sys;print("%d%d"%sys.version_info[:2])')-none-any.whl"
  if [ -f "$whl" ]; then
    log "using cached Horovod wheel $whl"
  else
    build_horovod "$whl"
  fi
  pip_quiet install -q --force-reinstall --no-deps "$whl"
  pip_quiet install -q cloudpickle psutil pyyaml packaging "cffi>=1.4.0"
  horovod_ok || { log "Horovod installed but its extensions do not import"; exit 1; }
}

ensure_project() {
  # Reinstall when pyproject.toml changes (new extras), not on every run.
  local stamp="$VENV/.hvd_gqsgd-$EXTRAS-$(sha256sum pyproject.toml | cut -c1-16)"
  if [ ! -f "$stamp" ]; then
    log "installing hvd_gqsgd[$EXTRAS] (editable)"
    pip_quiet install -q -e ".[$EXTRAS]"
    rm -f "$VENV"/.hvd_gqsgd-*
    touch "$stamp"
  fi
}

ensure_mpi
ensure_venv
ensure_horovod
ensure_project
log "ready: $VENV ($("$PY" -c 'import horovod, torch, tensorflow as tf; print("horovod", horovod.__version__, "torch", torch.__version__, "tf", tf.__version__)' 2>/dev/null))"
