"""Layers shared by the decoder-only presets, and the chunked causal-LM loss.

A preset turns a Hugging Face `*ForCausalLM` into an `nn.Sequential` of

    EmbeddingLayer  -> DecoderLayer x N -> LMHeadLayer

built from the HF module objects themselves, so parameter objects, names and the HF
`save_pretrained` output stay those of the original model. Between layers flows one tuple
(the "carry"):

    (hidden_states, attention_mask, position_ids, return_logits)

`hidden_states` is (mb, seq, hidden); `attention_mask` is the caller's 2D padding mask
(mb, seq) or None; `position_ids` is the caller's (mb, seq) / (1, seq) tensor or None (then
0..seq-1 per sequence); `return_logits` is the caller's output switch (see LMHeadLayer).
Only the small 2D inputs travel: every decoder layer rebuilds its rotary cos/sin and its
causal mask on its own device, because a (mb, 1, seq, seq) mask or the (mb, seq, head_dim)
cos/sin pair would cost transfer bandwidth at every stage boundary.

The head layer returns logits for inference, and for training the pair
`(normed_hidden_states, lm_head_weight)` that `causal_lm_loss` turns into the loss chunk by
chunk, so the (tokens, vocab) logits never exist in full (see ChunkedCrossEntropy).
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..context import (
    doing_recompute,
    recompute_data_or_none,
    save_for_recompute,
    saving_for_recompute,
)
from ..errors import ConfigError
from ._attention import SLOT_KWARG, kernels_work, route_attention

__all__ = [
    "DEFAULT_LOSS_CHUNK_TOKENS",
    "IGNORE_INDEX",
    "DecoderLayer",
    "EmbeddingLayer",
    "LMHeadLayer",
    "build_causal_lm_sequential",
    "causal_lm_loss",
    "causal_lm_loss_fn",
    "chunked_cross_entropy_sum",
    "count_loss_tokens",
]

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
# 2048 tokens x 151936 vocab x 4 bytes (fp32 logits) is 1.2 GiB per chunk: large enough
# for efficient GEMMs, small next to the (16 x 2048) x 151936 logits of a full micro-batch.
DEFAULT_LOSS_CHUNK_TOKENS = 2048

Carry = tuple[Tensor, Tensor | None, Tensor | None, bool | None]

_HALF = (torch.float16, torch.bfloat16)


class EmbeddingLayer(nn.Module):
    """Layer 0: token ids -> hidden states; takes the preset model's forward arguments."""

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        *,
        return_logits: bool | None = None,
    ) -> Carry:
        """Embed `input_ids` (mb, seq) and start the carry.

        Args:
            input_ids: Token ids, (mb, seq).
            attention_mask: 1 for tokens to attend to, 0 for padding, (mb, seq).
            position_ids: Positions for packed sequences, (mb, seq) or (1, seq); None means
                0..seq-1 in every row.
            return_logits: True: the model returns logits. False: it returns the
                `(hidden_states, lm_head_weight)` pair for `causal_lm_loss`. None: the
                pair when the head runs with gradients enabled outside a recompute (the
                last stage of `forward_backward`), logits otherwise (`forward()`).
        """
        if input_ids.dim() != 2:
            raise ConfigError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        return (self.embed_tokens(input_ids), attention_mask, position_ids, return_logits)


class DecoderLayer(nn.Module):
    """One HF decoder layer, with its rotary embedding and causal mask built on the device."""

    def __init__(
        self, layer: nn.Module, rotary_emb: nn.Module, config: Any, layer_idx: int
    ) -> None:
        super().__init__()
        self.layer = layer
        # A private copy (a few hundred bytes of inv_freq) keeps the buffer standalone, so no
        # two layers share a buffer that the engine uploads.
        self.rotary_emb = copy.deepcopy(rotary_emb)
        self.config = config
        layer_types = getattr(config, "layer_types", None)
        self.sliding = bool(layer_types) and layer_types[layer_idx] == "sliding_attention"
        # Set by the preset (engine.models.DISABLE_TORCH_COMPILE); read-only in forward.
        self.use_compile = False
        attention = getattr(layer, "self_attn", None)
        # Whether the attention can skip its recompute (see _attention): HF "sdpa" only.
        self.attention_routed = attention is not None and route_attention(attention)
        heads = config.num_attention_heads
        self.attention_shape = (
            heads,
            getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads,
        )

    def forward(self, carry: Carry) -> Carry:
        """Run the decoder layer on the carry's hidden states; pass the rest along."""
        hidden, attention_mask, position_ids, return_logits = carry
        positions = position_ids
        if positions is None:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden, positions)
        # The caller's position_ids (not the default arange) go to the mask builder: only
        # they can describe packing, and HF's packing check costs a host sync.
        mask = build_causal_mask(
            self.config, hidden, attention_mask, position_ids, sliding=self.sliding
        )
        # Compiled only for half precision on CUDA: fp32 models keep plain PyTorch's exact
        # numerics (inductor's fused kernels differed by ~4e-4 relative in an fp32 test on
        # the H100, unexplained yet), far below fp16/bf16 resolution.
        compiled = self.use_compile and hidden.is_cuda and hidden.dtype in _HALF
        args = (self.layer, hidden, mask, positions, *position_embeddings)
        mode = self._attention_mode(hidden, mask)
        if mode == "save":
            call = _compiled_saving_call() if compiled else _decoder_call_saving_attention
            out, attn_out, attn_lse = call(*args)
            save_for_recompute(attn_out, attn_lse)
        else:
            call = _compiled_decoder_call() if compiled else _decoder_call
            out = call(*args, recompute_data_or_none() if mode == "replay" else None)
        return (out, attention_mask, position_ids, return_logits)

    def _attention_mode(self, hidden: Tensor, mask: Any) -> str | None:
        """'save' (a forward that will be recomputed), 'replay' (that recompute) or None.

        Only plain causal attention (no mask, dropout or sliding window) in half precision
        on CUDA, where the cuDNN kernels run.
        """
        from . import RECOMPUTE_ATTENTION  # the package imports this module first

        if (
            RECOMPUTE_ATTENTION
            or not self.attention_routed
            or mask is not None
            or self.sliding
            or not hidden.is_cuda
            or hidden.dtype not in _HALF
        ):
            return None
        attention = self.layer.self_attn
        if getattr(attention, "sliding_window", None) is not None or (
            attention.training and getattr(attention, "attention_dropout", 0.0) > 0
        ):
            return None
        if doing_recompute():
            saved = recompute_data_or_none()
            return "replay" if saved is not None and len(saved) == 2 else None
        if torch.is_grad_enabled() or not saving_for_recompute():
            return None
        if not kernels_work(hidden.device, hidden.dtype, *self.attention_shape):
            return None
        return "save"


def _decoder_call(
    layer: nn.Module,
    hidden: Tensor,
    mask: Tensor | None,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    attention: Any = None,
) -> Tensor:
    """One HF decoder layer on (mb, seq, hidden) states; `attention` is the slot for
    `_attention.saved_attention_forward` (None: plain attention)."""
    kwargs = {} if attention is None else {SLOT_KWARG: attention}
    out = layer(
        hidden,
        attention_mask=mask,
        position_ids=positions,
        position_embeddings=(cos, sin),
        **kwargs,
    )
    # Older transformers releases return a 1-tuple from decoder layers.
    return out[0] if isinstance(out, tuple) else out


def _decoder_call_saving_attention(
    layer: nn.Module,
    hidden: Tensor,
    mask: Tensor | None,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """`_decoder_call` that also returns the attention output and log-sum-exp."""
    slot: list[Tensor] = []
    out = _decoder_call(layer, hidden, mask, positions, cos, sin, slot)
    return out, slot[0], slot[1]


# One compiled variant per (device, grad mode, input shapes): two per GPU for a decoder
# layer. dynamo's default of 8 would leave GPUs 5-8 of an 8-GPU box running eagerly.
_RECOMPILE_LIMIT = 64


def compile_for_devices(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compile(fn)` made safe to call from the engine's device threads at once.

    While one thread compiles, inductor may FX-trace (it sets a process-wide flag), and
    dynamo then refuses a compiled call from any other thread ("using FX to symbolically
    trace a dynamo-optimized function"): seen on two H200s, where both controller threads
    compile their first layer together. With `error_on_nested_fx_trace` off such a call
    runs the function eagerly instead (same math, fused differently); compilations
    themselves are serialised by dynamo's own lock.
    """
    import torch._dynamo.config as dynamo_config

    dynamo_config.error_on_nested_fx_trace = False
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=False)


@functools.cache
def _compiled_decoder_call() -> Callable[..., Tensor]:
    """`_decoder_call` under torch.compile, shared by every layer and device.

    The layer is an argument, not a compiled module: the engine runs device-side replicas
    of each layer, and torch.compile lifts their parameters as graph inputs, so all
    decoder layers of one shape share one compiled graph (one for grad, one for no-grad).
    On the H100 this fuses HF's fp32 RMSNorm, rotary and SwiGLU elementwise work: the fp16
    Qwen3-1.7B step's compute went from 6.0 s to 3.8 s of GPU time.
    """
    return compile_for_devices(_decoder_call)


@functools.cache
def _compiled_saving_call() -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """`_decoder_call_saving_attention` under torch.compile (see `_compiled_decoder_call`)."""
    return compile_for_devices(_decoder_call_saving_attention)


class LMHeadLayer(nn.Module):
    """Last layer: final norm, then logits (inference) or the pair for the chunked loss."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        if lm_head.bias is not None:
            raise NotImplementedError(
                "the causal-LM head preset supports lm_head without bias only"
            )
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, carry: Carry) -> Tensor | tuple[Tensor, Tensor]:
        """Return logits (mb, seq, vocab), or `(normed_hidden, lm_head.weight)` for training."""
        hidden, _, _, return_logits = carry
        hidden = self.norm(hidden)
        if return_logits is None:
            # The pair only where a loss is taken right here under autograd (the fused last
            # stage of forward_backward, plain use); a no-grad forward and its recompute
            # must agree on the output's structure, so both give logits.
            return_logits = not torch.is_grad_enabled() or doing_recompute()
        if return_logits:
            return self.lm_head(hidden)
        return (hidden, self.lm_head.weight)


def build_causal_lm_sequential(model: nn.Module) -> nn.Sequential:
    """Return the `nn.Sequential` of a HF `*ForCausalLM` with the usual `model.*` layout.

    The layout is `model.model.{embed_tokens, layers, norm, rotary_emb}` and `model.lm_head`
    (Qwen3, Llama, and their relatives). The HF modules are reused, not copied.
    """
    base = model.model
    config = model.config
    layers: list[nn.Module] = [EmbeddingLayer(base.embed_tokens)]
    num_layers = getattr(config, "num_hidden_layers", len(base.layers))
    for idx, layer in enumerate(list(base.layers)[:num_layers]):
        layers.append(DecoderLayer(layer, base.rotary_emb, config, idx))
    layers.append(LMHeadLayer(base.norm, model.lm_head))
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        log.warning(
            "gradient checkpointing is on in the HF model; RoundPipe recomputes layers "
            "itself, so the HF checkpointing only adds work"
        )
    return nn.Sequential(*layers)


@functools.cache
def _parameter_names(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def build_causal_mask(
    config: Any,
    hidden: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
    *,
    sliding: bool,
) -> Any:
    """Return the mask HF's attention expects for `config._attn_implementation`.

    Calls transformers' own mask builders, so sdpa (None when plain causal), eager (an
    additive float mask), flash_attention_2 (the 2D mask or None) and flex all get what
    their kernels want. Argument names differ across transformers 5.x releases
    (`input_embeds`/`inputs_embeds`, `cache_position`), hence the signature lookup.
    """
    from transformers import masking_utils

    fn = (
        masking_utils.create_sliding_window_causal_mask
        if sliding
        else masking_utils.create_causal_mask
    )
    params = _parameter_names(fn)
    kwargs: dict[str, Any] = {
        "config": config,
        "attention_mask": attention_mask,
        "past_key_values": None,
    }
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = hidden
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    return fn(**kwargs)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of token cross-entropies of `hidden @ weight.T`, computed chunk by chunk.

    Forward keeps only the per-token log-sum-exp; backward recomputes each chunk's logits,
    so peak memory is one chunk of (chunk, vocab) logits instead of (tokens, vocab).
    Logits are computed in the input dtype (as `lm_head` would) and upcast to fp32 for the
    softmax, like transformers' loss; the weight gradient is accumulated in fp32.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        chunk_tokens: int,
        ignore_index: int,
    ) -> Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        fused = _fused_loss_kernels(hidden)
        lse_and_loss = fused[0] if fused is not None else lse_and_loss_of_chunk
        for start in range(0, hidden.shape[0], chunk_tokens):
            stop = min(start + chunk_tokens, hidden.shape[0])
            lse[start:stop], part = lse_and_loss(
                hidden[start:stop] @ weight.t(), targets[start:stop], ignore_index
            )
            total += part
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        ctx.ignore_index = ignore_index
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if need_weight
            else None
        )
        scale = grad_total.float()
        fused = _fused_loss_kernels(hidden)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            stop = min(start + ctx.chunk_tokens, hidden.shape[0])
            h = hidden[start:stop]
            tgt = targets[start:stop]
            if fused is not None:
                grad_logits = fused[1](
                    h @ weight.t(), lse[start:stop], tgt, scale, ctx.ignore_index
                )
            else:
                # grad_logits_of_chunk's math, in place: one fp32 chunk instead of three
                logits = (h @ weight.t()).float()  # (chunk, vocab)
                valid = tgt != ctx.ignore_index
                # d(lse - logit[t]) / d logits = softmax - onehot(t); ignored tokens get 0.
                grad_logits = logits.sub_(lse[start:stop].unsqueeze(1)).exp_()  # in place
                rows = torch.arange(stop - start, device=h.device)
                grad_logits[rows, torch.where(valid, tgt, 0)] -= 1.0
                grad_logits.mul_((valid.float() * scale).unsqueeze(1))
                grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += _matmul_fp32_out(grad_logits.t(), h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def lse_and_loss_of_chunk(
    logits: Tensor, targets: Tensor, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """Per-token log-sum-exp (fp32) and summed cross-entropy of one chunk of logits."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    valid = targets != ignore_index
    picked = x.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    return lse, torch.where(valid, lse - picked, 0.0).sum()


def grad_logits_of_chunk(
    logits: Tensor, lse: Tensor, targets: Tensor, scale: Tensor, ignore_index: int
) -> Tensor:
    """d loss / d logits of one chunk, in the logits' dtype: (softmax - onehot) * scale,
    zero for ignored tokens."""
    valid = targets != ignore_index
    probs = torch.exp(logits.float() - lse.unsqueeze(1))
    cols = torch.arange(logits.shape[1], device=logits.device)
    onehot = cols.unsqueeze(0) == torch.where(valid, targets, 0).unsqueeze(1)
    grad = (probs - onehot.to(probs.dtype)) * (valid.to(probs.dtype) * scale).unsqueeze(1)
    return grad.to(logits.dtype)


@functools.cache
def _compiled_loss_kernels() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The two chunk functions under torch.compile (one fused kernel each).

    Eager, a chunk's fp32 upcast, log-sum-exp, softmax and one-hot subtraction are a
    dozen passes over (chunk x vocab) floats: on the H100 the Qwen3-1.7B step spent
    ~0.5 s of its 4 s in them.
    """
    return (
        compile_for_devices(lse_and_loss_of_chunk),
        compile_for_devices(grad_logits_of_chunk),
    )


def _fused_loss_kernels(
    hidden: Tensor,
) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The compiled chunk functions for fp16/bf16 on CUDA, as for the decoder layers
    (fp32 keeps eager numerics); None where the eager in-place path runs."""
    from . import DISABLE_TORCH_COMPILE  # the package imports this module first

    if DISABLE_TORCH_COMPILE or not hidden.is_cuda or hidden.dtype not in _HALF:
        return None
    return _compiled_loss_kernels()


@functools.cache
def _fp32_out_matmul_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch.mm(..., out_dtype=float32)` runs for half inputs on this backend."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _matmul_fp32_out(a: Tensor, b: Tensor) -> Tensor:
    """Return a @ b in fp32; half inputs keep the half GEMM but skip rounding its output.

    Each chunk's weight-gradient partial would otherwise be rounded to fp16/bf16 before
    the fp32 sum over chunks (cuBLAS can write fp32 directly; the CPU cannot).
    """
    if a.dtype == torch.float32:
        return a @ b
    if _fp32_out_matmul_works(a.device.type, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def chunked_cross_entropy_sum(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Return the fp32 sum over tokens of cross_entropy(hidden @ weight.T, targets).

    Args:
        hidden: (tokens, hidden) inputs of the output projection.
        weight: (vocab, hidden) output projection.
        targets: (tokens,) class ids; `ignore_index` entries add nothing.
        chunk_tokens: Tokens per chunk of logits.
    """
    if chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return ChunkedCrossEntropy.apply(hidden, weight, targets, chunk_tokens, ignore_index)


def _shift_labels(labels: Tensor, ignore_index: int) -> Tensor:
    """Targets for causal LM: position t predicts labels[t + 1]; the last one predicts nothing."""
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def count_loss_tokens(
    labels: Tensor, *, ignore_index: int = IGNORE_INDEX, shifted: bool = False
) -> int:
    """Return how many tokens of `labels` (batch, seq) contribute to the causal-LM loss."""
    targets = labels if shifted else labels[..., 1:]
    return int((targets != ignore_index).sum().item())


def causal_lm_loss(
    outputs: Tensor | tuple[Tensor, Tensor] | list[Tensor],
    labels: Tensor,
    *,
    num_items_in_batch: int | Tensor | None = None,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
    shifted: bool = False,
) -> Tensor:
    """Return the causal-LM cross-entropy (fp32) of a preset model's outputs.

    Matches transformers' `ForCausalLMLoss`: labels are shifted by one (unless `shifted`),
    `ignore_index` tokens are skipped, and the result is the mean over counted tokens, or
    their sum divided by `num_items_in_batch` when given.

    Args:
        outputs: The head layer's output: the `(normed_hidden, lm_head_weight)` pair (the
            chunked path), or logits (mb, seq, vocab).
        labels: (mb, seq) token ids, `ignore_index` where no loss is wanted.
        num_items_in_batch: Divisor for the summed loss; pass the count over the whole
            batch (`count_loss_tokens`) so per-micro-batch losses add up to the batch mean.
        chunk_tokens: Tokens per chunk of logits.
        shifted: `labels` are already the next-token targets (e.g. packed data).
    """
    targets = labels if shifted else _shift_labels(labels, ignore_index)
    if isinstance(outputs, Tensor):
        logits = outputs
        flat_targets = targets.reshape(-1).to(logits.device)
        total = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            flat_targets,
            ignore_index=ignore_index,
            reduction="sum",
        )
    elif isinstance(outputs, (tuple, list)) and len(outputs) == 2:
        hidden, weight = outputs
        flat_targets = targets.reshape(-1).to(hidden.device)
        total = chunked_cross_entropy_sum(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            flat_targets,
            chunk_tokens=chunk_tokens,
            ignore_index=ignore_index,
        )
    else:
        raise ConfigError(
            "causal_lm_loss expects logits or the (hidden_states, lm_head_weight) pair of a "
            f"preset model's head, got {type(outputs).__name__}"
        )
    if num_items_in_batch is None:
        num_items_in_batch = (flat_targets != ignore_index).sum()
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def causal_lm_loss_fn(
    labels: Tensor | None = None,
    *,
    num_items_in_batch: int | None = None,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
    shifted: bool = False,
) -> Callable[[Any, Tensor], Tensor]:
    """Return a `loss_fn(outputs, labels)` for `forward_backward` over a preset model.

    With the whole batch's `labels` (or `num_items_in_batch`), each micro-batch's loss is
    its summed token loss over the batch's token count, so the sum that `forward_backward`
    returns, and its gradients, equal the full-batch mean loss of the HF model.
    """
    if num_items_in_batch is None and labels is not None:
        num_items_in_batch = count_loss_tokens(labels, ignore_index=ignore_index, shifted=shifted)
    if num_items_in_batch is not None and num_items_in_batch < 1:
        # No counted token: a zero loss (and zero gradients) rather than 0/0.
        num_items_in_batch = 1

    def loss_fn(outputs: Any, mb_labels: Tensor) -> Tensor:
        return causal_lm_loss(
            outputs,
            mb_labels,
            num_items_in_batch=num_items_in_batch,
            chunk_tokens=chunk_tokens,
            ignore_index=ignore_index,
            shifted=shifted,
        )

    return loss_fn
