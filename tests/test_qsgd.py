"""Single-process: QSGDAllgather's constructor and repr.  It quantizes each tensor whole
against its own max, so GlobalQSGD's bucket, block, norm and scheme arguments must be refused,
not silently ignored; what it keeps of GlobalQSGD's contract still works."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from hvd_gqsgd import GlobalQSGD, QSGDAllgather, qsgd

# GlobalQSGD's arguments as the caller would spell them, and a value GlobalQSGD accepts
IGNORED = {"norm": "l2", "bucket_bytes": 0, "chunk_bytes": 0, "scale_block": 0,
           "hierarchical": True, "two_stage": True, "rotation": "hadamard"}


def test_repr_names_the_class_and_its_own_arguments():
    assert repr(QSGDAllgather()) == "QSGDAllgather(bits=8, seed=None)"
    assert repr(QSGDAllgather(4, seed=3)) == "QSGDAllgather(bits=4, seed=3)"
    assert repr(GlobalQSGD(bits=8)).startswith("GlobalQSGD(")


@pytest.mark.parametrize("name", sorted(IGNORED))
def test_globalqsgd_only_arguments_are_refused_by_name(name):
    GlobalQSGD(**{name: IGNORED[name]})  # the value itself is valid
    with pytest.raises(TypeError, match=rf"QSGDAllgather ignores {name}, as it quantizes each "
                                        r"tensor whole against its own max"):
        QSGDAllgather(bits=8, **{name: IGNORED[name]})


def test_every_globalqsgd_argument_is_kept_or_refused():
    """A new GlobalQSGD argument must be added to the refused list (or kept) deliberately."""
    global_args = set(inspect.signature(GlobalQSGD).parameters)
    kept = set(inspect.signature(QSGDAllgather).parameters) - {"refused"}
    assert kept == {"bits", "seed", "process_set"}
    assert global_args - kept == set(IGNORED) == set(qsgd._GLOBAL_ONLY)


def test_unknown_arguments_and_a_second_positional_are_refused():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bitz'"):
        QSGDAllgather(bitz=8)
    with pytest.raises(TypeError, match="positional"):
        QSGDAllgather(8, "max")  # GlobalQSGD's second positional (norm) would be seed here


def test_kept_arguments_reach_the_settings_and_are_validated():
    comp = QSGDAllgather(bits=4, seed=7, process_set="set")
    assert (comp.settings.bits, comp.settings.seed, comp.process_set) == (4, 7, "set")
    with pytest.raises(ValueError, match="bits must be in"):
        QSGDAllgather(bits=1)


def test_hooks_keep_globalqsgds_contract():
    comp = QSGDAllgather(bits=8)
    assert isinstance(comp, GlobalQSGD)
    assert comp.decompress("untouched", None) == "untouched"  # no ctx: passed through
    with pytest.raises(TypeError, match=r"compression=QSGDAllgather\(bits=8\), with parenth"):
        QSGDAllgather.compress(np.ones(3, np.float32))
