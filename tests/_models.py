"""Small models shared by the parity tests; parameter sizes do not divide by 2, 3 or 4."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 13
DIM = 7


class Block(nn.Module):
    """A residual MLP block with a LayerNorm (numels 7*11+11, 11*7+7, 7+7)."""

    def __init__(self, dim: int = DIM, hidden: int = 11) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class ToyLM(nn.Module):
    """Embedding -> blocks -> head. ``tie=True`` ties head and embedding weights."""

    def __init__(self, n_blocks: int = 3, tie: bool = False, unused: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.n_blocks = n_blocks
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        # A parameter that no forward ever uses: its gradient must stay zero / None.
        self.unused = nn.Linear(3, 5) if unused else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for i in range(self.n_blocks):  # indexing works even when the ModuleList is wrapped
            x = self.blocks[i](x)
        return self.head(x)


def make_toy(seed: int = 0, **kwargs: object) -> ToyLM:
    torch.manual_seed(seed)
    return ToyLM(**kwargs)  # type: ignore[arg-type]


def global_batch(step: int, world_size: int, per_rank: int = 4, seq: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets for all ranks (rank r uses rows [r*per_rank, (r+1)*per_rank))."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (world_size * per_rank, seq), generator=g)
    targets = torch.randint(0, VOCAB, (world_size * per_rank, seq), generator=g)
    return tokens, targets


def local_rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = t.shape[0] // world_size
    return t[rank * per_rank : (rank + 1) * per_rank]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train_against_reference(models: list[nn.Module], steps: int = 3, lr: float = 0.01) -> None:
    """AdamW steps: ``models[0]`` (single-process reference) on the global batch, the others
    (FSDP-wrapped) on this rank's rows; same data per step for all."""
    import torch.distributed as dist

    rank, ws = dist.get_rank(), dist.get_world_size()
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr) for m in models]
    for step in range(steps):
        tokens, targets = global_batch(step, ws)
        for i, (model, opt) in enumerate(zip(models, opts)):
            x, y = (tokens, targets) if i == 0 else (local_rows(tokens, rank, ws), local_rows(targets, rank, ws))
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
