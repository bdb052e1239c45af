"""Character-level tokenizer and deterministic per-rank batch sampling for the example.

The corpus is a small public-domain English text next to this module
(``examples/data/corpus.txt``). Batches are random windows of the encoded corpus; the
windows of a batch are a pure function of ``(seed, rank, step)``, so every rank draws a different
batch at every step and a run is reproducible regardless of how many steps were taken before.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

__all__ = ["CORPUS_RESOURCE", "load_corpus", "CharTokenizer", "batch_seed", "sample_batch"]

#: Location of the corpus, relative to this module's folder.
CORPUS_RESOURCE = "data/corpus.txt"


def load_corpus() -> str:
    """Return the text of the shipped corpus (UTF-8)."""
    return (Path(__file__).parent / CORPUS_RESOURCE).read_text(encoding="utf-8")


class CharTokenizer:
    """Maps each distinct character of a text to an integer id (sorted by code point).

    Args:
        text: the text whose characters form the vocabulary.
    """

    def __init__(self, text: str) -> None:
        if not text:
            raise ValueError("cannot build a tokenizer from an empty text")
        self.chars: List[str] = sorted(set(text))
        self._stoi: Dict[str, int] = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.chars)

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text``; raises ``KeyError`` on a character outside the vocabulary."""
        try:
            return [self._stoi[ch] for ch in text]
        except KeyError as exc:
            raise KeyError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The text of a sequence of token ids (inverse of :meth:`encode`)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)

    def encode_tensor(self, text: str) -> torch.Tensor:
        """:meth:`encode` as a 1-D ``torch.long`` tensor."""
        return torch.tensor(self.encode(text), dtype=torch.long)


def batch_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit generator seed derived from ``(seed, rank, step)``.

    Hashing (rather than e.g. adding the three numbers) keeps distinct triples from colliding:
    ``seed + rank + step`` would give rank 1 at step 0 the batch of rank 0 at step 1.
    """
    digest = hashlib.sha256(f"{seed}:{rank}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sample_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, *, seed: int, rank: int, step: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch_size`` random windows of ``seq_len + 1`` tokens from ``data``.

    Args:
        data: 1-D tensor of token ids (the encoded corpus).
        batch_size: number of sequences.
        seq_len: tokens per sequence.
        seed, rank, step: together determine the batch (see :func:`batch_seed`).

    Returns:
        ``(inputs, targets)``, both ``(batch_size, seq_len)`` ``torch.long`` CPU tensors, where
        ``targets[:, t]`` is the token following ``inputs[:, t]``.
    """
    if data.dim() != 1:
        raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError("batch_size and seq_len must be positive")
    if data.numel() < seq_len + 1:
        raise ValueError(f"corpus of {data.numel()} tokens is too short for seq_len={seq_len}")
    generator = torch.Generator().manual_seed(batch_seed(seed, rank, step))
    starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    windows = data[starts.unsqueeze(1) + offsets]  # (batch_size, seq_len + 1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
