"""A runnable example for ``fsdp``: a small character-level GPT trained with FSDP.

- :mod:`fsdp.examples.model`: a GPT-style decoder-only language model in plain PyTorch.
- :mod:`fsdp.examples.data`: a character tokenizer and a deterministic per-rank batch sampler
  over the public-domain corpus shipped in ``fsdp/examples/data/corpus.txt``.
- :mod:`fsdp.examples.train`: the trainer, run as ``python -m fsdp.examples.train``.

Only the model and data modules are imported here (they need nothing but ``torch``); the trainer
is imported when it is run.
"""

from fsdp.examples.data import CharTokenizer, load_corpus, sample_batch
from fsdp.examples.model import GPT, PRESETS, Block, GPTConfig

__all__ = [
    "Block",
    "CharTokenizer",
    "GPT",
    "GPTConfig",
    "PRESETS",
    "load_corpus",
    "sample_batch",
]
