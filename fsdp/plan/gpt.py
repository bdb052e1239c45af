"""A small GPT-style decoder-only language model, written from scratch in plain PyTorch.

It is the model ``python -m fsdp.plan`` plans when no ``--model`` is given, so it lives in the
package; the example trainer (``examples/``) and the benchmarks (``benchmarks/``), which are not
installed, import it from here.

Architecture (pre-LayerNorm transformer decoder)::

    tokens -> token embedding + learned position embedding -> dropout
           -> n_layer x Block(x + attn(ln_1(x)); x + mlp(ln_2(x)))
           -> final LayerNorm -> output head (vocab logits)

Each :class:`Block` is self-contained, so it is the natural unit for FSDP auto-wrapping with
``ModuleWrapPolicy({Block})``: every block becomes one FSDP unit (one flat parameter) and the
embeddings, final LayerNorm and head stay with the root unit.

The output head is deliberately *not* tied to the token embedding: tied weights would make one
parameter shared between two modules, which is not part of what the example exercises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "PRESETS", "CausalSelfAttention", "MLP", "Block", "GPT", "checkpoint_blocks"]


#: Named model sizes: ``name -> (n_layer, n_head, d_model)``. ``vocab_size`` comes from the
#: tokenizer and ``block_size`` from the sequence length, so they are not part of a preset.
PRESETS: Dict[str, Tuple[int, int, int]] = {
    "tiny": (4, 4, 128),  # ~0.8M parameters: the trainer's default (about a minute on 2 CPU cores)
    "small": (6, 6, 384),  # ~10.7M parameters
    "medium": (12, 12, 768),  # ~85M parameters (GPT-2 small sized body)
}


@dataclass
class GPTConfig:
    """Hyperparameters of :class:`GPT`.

    Attributes:
        vocab_size: number of distinct tokens (characters, for the example tokenizer).
        block_size: maximum sequence length (size of the position embedding table).
        n_layer: number of transformer blocks.
        n_head: number of attention heads; must divide ``d_model``.
        d_model: width of the residual stream.
        dropout: dropout probability (embeddings, attention, residual branches).
    """

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    d_model: int
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def from_preset(
        cls, name: str, vocab_size: int, block_size: int, dropout: float = 0.0
    ) -> "GPTConfig":
        """Build the config of the named size preset (one of :data:`PRESETS`)."""
        try:
            n_layer, n_head, d_model = PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown model preset {name!r}; choose from {sorted(PRESETS)}"
            ) from None
        return cls(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            d_model=d_model,
            dropout=dropout,
        )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention using ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.d_model = config.d_model
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(batch, seq, d_model)`` to ``(batch, seq, d_model)``; position t sees only <= t."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(self.d_model, dim=2)
        # (b, t, c) -> (b, n_head, t, head_dim)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: ``d_model -> 4 d_model -> GELU -> d_model``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer decoder block (the FSDP auto-wrap unit)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Decoder-only language model: ``forward(idx)`` returns next-token logits.

    Args:
        config: the model hyperparameters.

    ``forward`` takes token ids of shape ``(batch, seq)`` with ``seq <= config.block_size`` and
    returns logits of shape ``(batch, seq, vocab_size)``; the logits at position ``t`` depend
    only on tokens ``0..t``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style initialisation: N(0, 0.02) weights, zero biases, and residual output
        projections scaled by ``1 / sqrt(2 * n_layer)``."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            assert isinstance(block, Block)
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_parameters(self) -> int:
        """Total number of parameters (call before wrapping with FSDP)."""
        return sum(p.numel() for p in self.parameters())


def checkpoint_blocks(model: nn.Module, block_cls: type = Block) -> None:
    """Wraps every ``block_cls`` in ``model`` in a non-reentrant activation-checkpoint wrapper
    (torch's ``apply_activation_checkpointing``), as the planner's and the tests' GPTs do."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, block_cls),
    )
