#!/usr/bin/env bash
# The CUDA path's check, in one command for a GPU machine (run from anywhere in the checkout):
#
#   bash scripts/gpu_check.sh
#
# Runs tests/test_cuda.py (the engine, DDP and FSDP2 hooks on CUDA tensors, and a 64 MB
# gradient round against fp16 compression) and ends with ONE summary line:
#
#   gpu_check: <GPU name>: N passed, M skipped, K failed; 64 MB round <x> ms (fp16 <y> ms),
#   peak <z> MB (fp16 <w> MB); DDP hook <a> ms (fp16 hook <b> ms)
#
# The Python: .venv/bin/python if its torch sees CUDA, else the system python3 if its torch
# does (no Horovod needed: the tests that need it skip, saying why).  Where no torch sees CUDA
# the same tests run and every one skips with its reason; the line then says
# "no CUDA device: CUDA parts skipped".  Needs torch, numpy and pytest, no network.
# Exit status: 0 when nothing failed; 124 when the run passed GPU_CHECK_TIMEOUT_S (420 s).
#
# --cpu-rehearsal runs the same checks on CPU tensors and Gloo, through the torch ops that
# CUDA tensors take (GQSGD_TEST_DEVICE=cpu HVD_GQSGD_KERNELS=0, a 4 MB round, no memory
# figures): a machine without a GPU finds out whether the GPU run would trip over the tests.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
LIMIT_S=${GPU_CHECK_TIMEOUT_S:-420}
if [ ! -f tests/test_cuda.py ]; then  # the Docker images copy scripts/ but not tests/
  echo "gpu_check: $ROOT has no tests/test_cuda.py; run it from a checkout of the repository" >&2
  exit 2
fi
REHEARSAL=0
case "${1:-}" in
  "") ;;
  --cpu-rehearsal) REHEARSAL=1 ;;
  *) echo "usage: bash scripts/gpu_check.sh [--cpu-rehearsal]" >&2; exit 2 ;;
esac

# 0 if $1's torch sees a CUDA device (bounded: a wedged driver must not hang the check)
sees_cuda() {
  timeout 120 "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    >/dev/null 2>&1
}
can_test() { timeout 120 "$1" -c 'import torch, numpy, pytest' >/dev/null 2>&1; }

PY="" DEVICE=""
[ "$REHEARSAL" = 1 ] && DEVICE="CPU rehearsal (torch ops, Gloo)"
for candidate in .venv/bin/python python3; do
  [ "$REHEARSAL" = 1 ] && break
  if command -v "$candidate" >/dev/null 2>&1 && sees_cuda "$candidate"; then
    PY=$candidate
    DEVICE=$(timeout 120 "$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')
    break
  fi
done
if [ -z "$PY" ]; then
  [ "$REHEARSAL" = 1 ] || DEVICE="no CUDA device: CUDA parts skipped"
  for candidate in .venv/bin/python python3; do
    if command -v "$candidate" >/dev/null 2>&1 && can_test "$candidate"; then
      PY=$candidate
      break
    fi
  done
  if [ -z "$PY" ]; then
    echo "gpu_check: no Python here imports torch, numpy and pytest (tried .venv/bin/python," \
         "python3); run 'make setup' or install them" >&2
    exit 2
  fi
fi
echo "gpu_check: $("$PY" -c 'import sys, torch
print(sys.executable, "torch", torch.__version__, "CUDA", torch.version.cuda)')," \
     "${DEVICE}, limit ${LIMIT_S} s"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export GPU_CHECK_JSON="$TMP/bench.json" GQSGD_TEST_DEVICE=cuda
[ "$REHEARSAL" = 1 ] && export GQSGD_TEST_DEVICE=cpu HVD_GQSGD_KERNELS=0
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
timeout --kill-after=20 "$LIMIT_S" "$PY" -m pytest -q -rs -p no:cacheprovider \
  --junitxml="$TMP/junit.xml" tests/test_cuda.py
RC=$?

"$PY" - "$TMP/junit.xml" "$GPU_CHECK_JSON" "$DEVICE" "$RC" "$LIMIT_S" <<'PYEOF'
import json, os, sys
import xml.etree.ElementTree as ET

junit, bench, device, rc, limit = sys.argv[1:6]
counts = "no results"
if os.path.exists(junit):
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    counts = f"{total - skipped - failed} passed, {skipped} skipped, {failed} failed"
if rc in ("124", "137"):
    counts += f" (timed out after {limit} s)"
figures = json.load(open(bench)) if os.path.exists(bench) else {}
engine, ddp = figures.get("engine"), figures.get("ddp")
if engine:
    size = f"{engine['bytes'] >> 20} MB round"
    peak = ("peak not measured" if engine["gq8_peak_mb"] is None else
            f"peak {engine['gq8_peak_mb']:.0f} MB (fp16 {engine['fp16_peak_mb']:.0f} MB)")
    bench = f"{size} {engine['gq8_ms']:.1f} ms (fp16 {engine['fp16_ms']:.1f} ms), {peak}"
else:
    bench = "64 MB round not measured"
if ddp:
    bench += f"; DDP hook {ddp['gq8_ms']:.1f} ms (fp16 hook {ddp['fp16_ms']:.1f} ms)"
print(f"gpu_check: {device}: {counts}; {bench}")
PYEOF
exit "$RC"
