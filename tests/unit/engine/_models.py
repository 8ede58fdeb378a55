"""Small models shared by the engine tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a residual connection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(
            dim, 3 * dim, bias=False
        )  # a key bias has a zero gradient: Adam would amplify its rounding noise
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        # (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLPBlock(nn.Module):
    """Pre-norm MLP with GELU and dropout, residual."""

    def __init__(self, dim: int, p_drop: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(p_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


IN_DIM, DIM, OUT_DIM = 8, 16, 4


def make_model(p_drop: float = 0.1, seed: int = 0) -> nn.Sequential:
    """7 layers: Linear, LayerNorm, MLP (GELU, dropout), attention, MLP, Dropout, Linear."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_DIM, DIM),
        nn.LayerNorm(DIM),
        MLPBlock(DIM, p_drop),
        CausalSelfAttention(DIM, heads=2),
        MLPBlock(DIM, p_drop),
        nn.Dropout(p_drop),
        nn.Linear(DIM, OUT_DIM),
    )


def make_batch(batch: int = 20, seq: int = 5, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, IN_DIM, generator=g), torch.randn(
        batch, seq, OUT_DIM, generator=g
    )
