"""Small models shared by the engine tests (the Hugging Face ones: tests/tiny_models.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tests.tiny_models import tiny_model


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


def tied_qwen3_roundpipe(
    dtype: torch.dtype = torch.float32, **rp_kwargs: object
) -> tuple[nn.Module, nn.Module]:
    """A 4-layer tiny Qwen3 with a tied embedding (used by the first and the last layer) as
    a preset RoundPipe of one-layer groups, the tail split in two, 4 micro-batches; returns
    the HF model and the RoundPipe (`rp_kwargs` go to wrap_model_to_roundpipe)."""
    from engine import ModelExecutePlan, RoundPipeRunConfig, wrap_model_to_roundpipe

    model = tiny_model("qwen3", vocab_size=64, num_hidden_layers=4, dtype=dtype)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    n = 6  # embedding, 4 decoder layers, head
    plan = ModelExecutePlan.from_ranges(
        [range(k, k + 1) for k in range(n - 1)] + [range(n - 1, n)],
        [range(k, k + 1) for k in reversed(range(n - 1))],
        tail_split=2,
    )
    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=True,
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=4, execute_plan=plan),
        **rp_kwargs,
    )
    return model, rp


def train_tied_qwen3(
    optimizer: type[torch.optim.Optimizer], dtype: torch.dtype = torch.float32, **rp_kwargs: object
) -> tuple[nn.Module, list[float], dict[str, torch.Tensor]]:
    """Four steps of `tied_qwen3_roundpipe` with `optimizer` (lr 1e-2) on seeded token
    batches; returns the RoundPipe, the losses and the trained weights."""
    model, rp = tied_qwen3_roundpipe(dtype, **rp_kwargs)
    opt = optimizer(rp.optim_parameters(), lr=1e-2)  # type: ignore[call-arg]

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (8, 16), generator=g) for _ in range(4)]
    losses = lm_steps(rp, batches, step_fn)
    return rp, losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def lm_steps(rp: nn.Module, batches: list[torch.Tensor], step_fn: object) -> list[float]:
    """Causal-LM training steps of a preset RoundPipe on token batches (the chunked loss,
    asynchronous steps); returns the losses, with every step done."""
    from engine.models import causal_lm_loss_fn

    losses = []
    for ids in batches:
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "return_logits": False},
            label=ids,
            loss_fn=causal_lm_loss_fn(ids),
        )
        losses.append(float(loss))
        rp.step(step_fn)
    rp.synchronize()
    return losses
