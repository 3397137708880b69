"""Inputs and a NumPy oracle for the QPRSGD tests (pure NumPy, no framework).

Every rank ``r`` of ``n`` owns a full-batch least-squares problem
``f_r(W, b) = 1/(2m) * ||A_r W^T + b - Y_r||^2`` (no gradient noise: each step uses all of
the rank's rows).  The ranks' targets come from different linear models, so local steps make
the ranks drift apart and synchronisation has something to undo.  The global objective is
the mean of the ``f_r``; :func:`optimum` solves it in closed form.

tests/workers/qprsgd_worker.py trains on these problems under real Horovod;
tests/test_qprsgd.py replays the same algorithm here in float64 (:func:`simulate`).
"""

from __future__ import annotations

import numpy as np

ROWS, FEATURES, OUTPUTS = 256, 40, 2
SCALE_BLOCK = 32  # GlobalQSGD(scale_block=...) in the tests: W's 80 elements make 3 blocks


def problem(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(A_r, Y_r) of rank ``rank``, float64."""
    rng = np.random.default_rng([2004, 9125, rank])
    a = rng.standard_normal((ROWS, FEATURES))
    shared = np.random.default_rng([2004, 0]).standard_normal((OUTPUTS, FEATURES))
    own = shared + 0.5 * rng.standard_normal((OUTPUTS, FEATURES))
    y = a @ own.T + 0.1 * rng.standard_normal((ROWS, OUTPUTS)) + 0.3
    return a, y


def initial() -> tuple[np.ndarray, np.ndarray]:
    """(W0, b0): the same start on every rank."""
    rng = np.random.default_rng([2004, 1])
    return 0.1 * rng.standard_normal((OUTPUTS, FEATURES)), np.zeros(OUTPUTS)


def gradient(rank: int, w: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradient of f_r at (W, b)."""
    a, y = problem(rank)
    r = a @ w.T + b - y  # (ROWS, OUTPUTS)
    return r.T @ a / ROWS, r.mean(axis=0)


def optimum(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Minimiser of mean_r f_r over ``n`` ranks (equal rows per rank: a stacked lstsq)."""
    a = np.concatenate([problem(r)[0] for r in range(n)])
    y = np.concatenate([problem(r)[1] for r in range(n)])
    design = np.concatenate([a, np.ones((len(a), 1))], axis=1)
    sol = np.linalg.lstsq(design, y, rcond=None)[0]  # (FEATURES + 1, OUTPUTS)
    return sol[:-1].T, sol[-1]


def lr_at(t: int, lr0: float) -> float:
    """Learning rate of step t (from 1): decays so local SGD's drift bias vanishes."""
    return lr0 / (1.0 + t / 50.0)


def simulate(n: int, steps: int, period: int, lr0: float, topology: str,
             gamma: float = 1.0) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Float64 replay of QPRSGD with exact communication (compression none) and plain SGD.

    Returns, for every step, every rank's (W, b) after that step (sync included).
    allreduce: x_bar += mean_i (x_i - x_bar); x_i = x_bar.  gossip (exact messages, so the
    public copies equal the models): x_i += gamma/3 * (x_{i-1} + x_{i+1} - 2 x_i).
    """
    w0, b0 = initial()
    xs = [(w0.copy(), b0.copy()) for _ in range(n)]
    history = []
    for t in range(1, steps + 1):
        lr = lr_at(t, lr0)
        xs = [(w - lr * gw, b - lr * gb)
              for r, (w, b) in enumerate(xs) for gw, gb in [gradient(r, w, b)]]
        if t % period == 0:
            if topology == "allreduce":
                mean = (np.mean([w for w, _ in xs], axis=0), np.mean([b for _, b in xs], axis=0))
                xs = [(mean[0].copy(), mean[1].copy()) for _ in range(n)]
            else:
                xs = [tuple(xs[r][k] + gamma / 3.0 * (
                    xs[(r - 1) % n][k] + xs[(r + 1) % n][k] - 2.0 * xs[r][k]) for k in (0, 1))
                      for r in range(n)]
        history.append([(w.copy(), b.copy()) for w, b in xs])
    return history
