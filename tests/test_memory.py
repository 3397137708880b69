"""Issue 42's memory goal on the torch-ops path (what CUDA tensors run, forced on CPU with
``HVD_GQSGD_KERNELS=0``): what a GlobalQSGD(8) round adds to the resident memory over the
same entry point's uncompressed round grows by at most half the gradient's bytes per byte of
gradient (Horovod flat and two-stage, the DDP hook, the FSDP2 hook), measured at two
gradient sizes so that the per-chunk part (fixed, whatever the model) cancels out.  Before
the chunking, this grew by about 12 bytes per gradient byte in the DDP hook.

benchmarks/memory.py runs the same jobs (at 256 MB by default) and writes docs/MEMORY.md;
this test uses 4 and 24 MB to stay short."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import memory  # noqa: E402

pytestmark = pytest.mark.multiproc

SIZES = [4, 24]
# below pytest's own timeout, so that a job that hangs fails with its output
JOB_TIMEOUT_S = 600


@pytest.mark.parametrize("entry", memory.ENTRIES)
def test_a_round_adds_at_most_half_the_gradient_per_gradient_byte(entry):
    rows = memory.measure(SIZES, [entry], [False], timeout=JOB_TIMEOUT_S)
    grows = memory.slope(rows, entry, False)
    assert grows <= memory.GOAL, (entry, grows, rows)
