"""A runnable example for ``fsdp``: a small character-level GPT trained with FSDP.

Not part of the installed package: run it from the repository root (``pip install -e .``
first), ``python -m examples.train``.

- :mod:`examples.train`: the trainer (``python -m examples.train --help``).
- :mod:`examples.data`: a character tokenizer and a deterministic per-rank batch sampler over the
  public-domain corpus in ``examples/data/corpus.txt``.
- :mod:`examples.checkpoint`: sharded, atomic checkpoints (model, optimizer, progress).
- The model is :mod:`fsdp.plan.gpt` (a GPT-style decoder in plain PyTorch), in the package
  because ``python -m fsdp.plan`` plans it by default.
"""
