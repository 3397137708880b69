#!/usr/bin/env bash
# Default command of the hvd_gqsgd images: what this Horovod was built with, then how to run
# the examples.  Works outside a container too, with a venv's horovodrun on PATH
# (tests/test_docker.py runs it that way).
set -euo pipefail
# TensorFlow's C++ logger prints its first lines whatever TF_CPP_MIN_LOG_LEVEL says, once for
# every framework horovodrun probes; they are noise here.
build=$(horovodrun --check-build 2>&1 | grep -v -e '^I0000 ' -e 'absl::InitializeLog')
printf '%s\n' "$build"

# The GPU image (docker/Dockerfile.gpu) has NCCL and no TensorFlow binding; its demo puts each
# rank's model and data on its GPU (--cuda).
run="docker run --rm hvd_gqsgd" cuda=""
if grep -qF '[X] NCCL' <<<"$build"; then
  run="docker run --rm --gpus all hvd_gqsgd:gpu" cuda=" --cuda"
fi
echo
echo "hvd_gqsgd is installed and its examples are in examples/. Two ranks in one container:"
echo
echo "  $run horovodrun -np 2 -H localhost:2 --gloo python examples/torch_digits.py$cuda"
if grep -qF '[X] TensorFlow' <<<"$build"; then
  echo "  $run horovodrun -np 2 -H localhost:2 python examples/tf_digits.py"
fi
cat <<'HINT'

--gloo picks Gloo; without it horovodrun uses Open MPI (root is allowed in the image). Add
--oversubscribe after -np when the container has fewer cores than ranks, and --shm-size=1g
to docker run for large models. Across hosts: see "Docker" in README.md.
HINT
