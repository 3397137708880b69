"""The char-LM examples' text: Python's own help topics (``pydoc_data.topics``, shipped with
Python, about 465,000 characters) as character ids, the last 10% held out.  Imports numpy and
torch only (no Horovod), so Horovod and torch.distributed examples share it."""

from __future__ import annotations

import pydoc_data.topics

import numpy as np
import torch

__all__ = ["Corpus", "VAL_FRACTION"]

VAL_FRACTION = 0.1


class Corpus:
    """The topic texts (in key order) as character ids, split into training and validation."""

    def __init__(self) -> None:
        text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
        self.chars = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.chars)}
        ids = np.fromiter((lookup[c] for c in text), dtype=np.int64, count=len(text))
        n_val = int(len(ids) * VAL_FRACTION)
        self.train, self.val = ids[:-n_val], ids[-n_val:]

    def unigram_entropy(self) -> float:
        """Nats per character of the training text's character frequencies."""
        p = np.bincount(self.train, minlength=len(self.chars)) / len(self.train)
        p = p[p > 0]
        return float(-(p * np.log(p)).sum())

    def val_windows(self, seq: int, n_chars: int) -> torch.Tensor:
        """Fixed, non-overlapping windows of ``seq + 1`` characters from the validation text."""
        count = min(n_chars, len(self.val) - 1) // seq
        starts = np.arange(count) * seq
        return torch.from_numpy(np.stack([self.val[s:s + seq + 1] for s in starts]))

    def train_batch(self, rng: np.random.Generator, batch: int, seq: int) -> torch.Tensor:
        starts = rng.integers(0, len(self.train) - seq - 1, batch)
        return torch.from_numpy(np.stack([self.train[s:s + seq + 1] for s in starts]))
