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


def tiny_hf_model(
    kind: str, *, vocab: int, window: int, intermediate_size: int = 64, **overrides: object
) -> nn.Module:
    """A random 2-layer fp32 `*ForCausalLM` of `kind` (hidden 32, 4 heads of 8, 2 kv heads).

    `window` is the sliding window where the family has one (short, so the sliding masks
    matter at the tests' lengths); MoE families get 4 experts, 2 per token.
    """
    import transformers

    common: dict[str, object] = {
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "use_cache": False,
        **overrides,
    }
    torch.manual_seed(0)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    elif kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "qwen2":
        config = transformers.Qwen2Config(
            use_sliding_window=True, sliding_window=window, max_window_layers=1, **common
        )
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "mistral":
        config = transformers.MistralConfig(**{"sliding_window": window, **common})
        model = transformers.MistralForCausalLM(config)
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **common
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    elif kind == "gpt_oss":
        config = transformers.GptOssConfig(
            num_local_experts=4, num_experts_per_tok=2, sliding_window=window, **common
        )
        model = transformers.GptOssForCausalLM(config)
    else:
        raise ValueError(kind)
    return model.float().train()


def tied_qwen3_roundpipe(
    dtype: torch.dtype = torch.float32, **rp_kwargs: object
) -> tuple[nn.Module, nn.Module]:
    """A 4-layer tiny Qwen3 with a tied embedding (used by the first and the last layer) as
    a preset RoundPipe of one-layer groups, the tail split in two, 4 micro-batches; returns
    the HF model and the RoundPipe (`rp_kwargs` go to wrap_model_to_roundpipe)."""
    from engine import ModelExecutePlan, RoundPipeRunConfig, wrap_model_to_roundpipe

    model = tiny_hf_model("qwen3", vocab=64, window=64, num_hidden_layers=4).to(dtype)
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
