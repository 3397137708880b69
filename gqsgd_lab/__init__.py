"""The lab bench of hvd_gqsgd: what the tests, benchmarks, studies and examples/demo.py share.

Not part of the library (``hvd_gqsgd`` never imports it) and no public API: it is here so
that scripts in different folders import the same code by one name instead of editing
``sys.path``.

Modules (import each one directly; this file imports nothing):

    emulated_hosts    network namespaces + tc as hosts on one machine (root), mpirun/horovodrun
    launch            a tests/workers/ script under horovodrun, mpirun or emulated hosts
    inputs            deterministic per-rank inputs of the multi-process tests and workers
    numpy_ops         NumPy implementation of hvd_gqsgd.core.TensorOps: the core's oracle
    two_stage_oracle  two-stage Global-QSGD simulated in NumPy from the algorithm's statement
    rotation_oracle   the Hadamard rotation written from its definition
    bench_common      benchmark workers' compressor names and arguments; doc sections
    simulate          one flat or two-stage sum on real gradients, in one process
    one_rank          GlobalQSGD's engine on one rank without Horovod (its own CPU a round)

How it is found: ``make setup`` (scripts/setup_env.sh) installs the checkout editable, and
pyproject.toml lists ``gqsgd_lab`` next to ``hvd_gqsgd``, so both import from any folder.
pytest adds the checkout to ``sys.path`` itself (``pythonpath`` in pyproject.toml), and every
launcher here passes ``PYTHONPATH`` = the checkout to the ranks it starts, so a checkout whose
virtualenv's editable install points at another checkout still runs its own code; run a
script by hand from such a checkout with ``PYTHONPATH=.``.
"""
