"""Layers shared by the decoder-only presets (the chunked causal-LM loss they take is `loss`).

Over ~600 lines: the three layers (embedding, decoder, head) share one carry and build
it, pass it on and end it; split apart, each would restate the carry's fields.

A preset turns a Hugging Face `*ForCausalLM` into an `nn.Sequential` of

    EmbeddingLayer  -> DecoderLayer x N -> LMHeadLayer

built from the HF module objects themselves, so parameter objects, names and the HF
`save_pretrained` output stay those of the original model. The Sequential takes the HF
causal-LM arguments (`input_ids`, `attention_mask`, `position_ids`, `labels`,
`logits_to_keep`, `return_dict`, `num_items_in_batch`, and `output_router_logits` for
mixture-of-experts families) and returns what the HF model returns: a
`CausalLMOutputWithPast`-like object with `.loss` when labels are given and `.logits`
(see LMHeadLayer and `_outputs` for what `.loss` means per micro-batch). Between layers
flows one tuple (the "carry"):

    (hidden_states, attention_mask, position_ids, labels, router_stats, options)

`hidden_states` is (mb, seq, hidden); `attention_mask` is the caller's 2D padding mask
(mb, seq) or None; `position_ids` is the caller's (mb, seq) / (1, seq) tensor or None (then
0..seq-1 per sequence); `labels` the caller's (mb, seq) labels or None; `router_stats` the
running sums of HF's load-balancing loss over the MoE layers so far, or None (see `_moe`);
`options` the caller's output switches (`HeadOptions`). Only these small inputs travel:
every decoder layer builds its rotary cos/sin and its causal mask on its own device,
because a (mb, 1, seq, seq) mask or the (mb, seq, head_dim) cos/sin pair would cost
transfer bandwidth at every stage boundary (for the default positions the cos/sin are
computed once per device and length, see `_rotary`).

The loss is taken from the final hidden states chunk by chunk, so the (tokens, vocab)
logits never exist in full for it (`loss.ChunkedCrossEntropy`); the logits themselves are
only computed where they are returned.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..context import (
    doing_recompute,
    recompute_data_or_none,
    save_for_recompute,
    saving_for_recompute,
)
from ..errors import ConfigError
from ._attention import SLOT_KWARG, kernels_work, route_attention
from ._compile import HALF_DTYPES as _HALF
from ._compile import compile_for_devices
from ._rotary import default_rotary, rotary_fingerprint
from .loss import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    IGNORE_INDEX,
    chunked_cross_entropy_sum,
    shift_labels,
)

__all__ = [
    "DEFAULT_MLP_CHUNK_SIZE",
    "DEFAULT_MLP_CHUNK_TOKENS",
    "DecoderLayer",
    "EmbeddingLayer",
    "HeadOptions",
    "LMHeadLayer",
    "MoeInfo",
    "build_causal_lm_sequential",
]

log = logging.getLogger(__name__)

# A decoder layer whose micro-batch has more tokens than this runs its MLP half chunk by
# chunk (see DecoderLayer.mlp_chunk_tokens). The MLP's three (tokens, intermediate) tensors
# (gate and up projections, act * up) are what autograd keeps most of (measured share:
# bench/RESULTS.md, "Figures moved out of engine docstrings").
# Above 128k tokens a micro-batch they decide whether a layer group fits; at or below it
# the unchunked (one compiled graph) path runs as before, so throughput at the usual
# 2048..131072 tokens is untouched.
DEFAULT_MLP_CHUNK_TOKENS = 131072
# Tokens per MLP chunk: 32768 x 6144 (Qwen3-1.7B's intermediate size) x 2 bytes is 384 MiB
# per (chunk, intermediate) tensor, a tenth of the 327,680-token micro-batch's, while each
# chunk's GEMMs still have 32768 rows, as many as a micro-batch of one 32k sequence.
DEFAULT_MLP_CHUNK_SIZE = 32768


class HeadOptions(NamedTuple):
    """The caller's output switches, carried from the first layer to the head."""

    return_logits: bool | None = None
    logits_to_keep: int | Tensor = 0
    return_dict: bool | None = None
    num_items_in_batch: int | float | Tensor | None = None
    output_router_logits: bool = False


class MoeInfo(NamedTuple):
    """What HF's load-balancing loss needs to know about a mixture-of-experts model."""

    num_experts: int
    top_k: int
    aux_coef: float  # HF's router_aux_loss_coef
    output_router_logits: bool  # the config's default for the argument of that name


# (hidden, attention_mask, position_ids, labels, router_stats, options)
Carry = tuple[
    Tensor, Tensor | None, Tensor | None, Tensor | None, tuple[Tensor, ...] | None, HeadOptions
]

# Arguments of HF's causal-LM forward that only make sense with a KV cache or per-layer
# outputs: accepted when they ask for nothing, refused otherwise.
_INERT_ARGUMENTS = ("past_key_values", "use_cache", "output_attentions", "output_hidden_states")


class EmbeddingLayer(nn.Module):
    """Layer 0: token ids -> hidden states; takes the preset model's forward arguments."""

    def __init__(self, embed_tokens: nn.Embedding, moe: MoeInfo | None = None) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.moe = moe

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        *,
        labels: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        return_dict: bool | None = None,
        num_items_in_batch: int | float | Tensor | None = None,
        output_router_logits: bool | None = None,
        return_logits: bool | None = None,
        **unsupported: Any,
    ) -> Carry:
        """Embed `input_ids` (mb, seq) and start the carry.

        Args:
            input_ids: Token ids, (mb, seq); or `inputs_embeds` (mb, seq, hidden) instead.
            attention_mask: 1 for tokens to attend to, 0 for padding, (mb, seq).
            position_ids: Positions for packed sequences, (mb, seq) or (1, seq); None means
                0..seq-1 in every row.
            labels: Token ids (mb, seq) for HF's causal-LM loss (shifted inside; -100 is
                ignored): the output then has `.loss`.
            logits_to_keep: HF's argument: an int keeps the logits of the last that many
                positions (0: all), a 1D tensor those positions. The loss always covers
                every position.
            return_dict: False returns HF's tuple (`output.to_tuple()`) instead.
            num_items_in_batch: HF's argument: `.loss` is the summed token loss divided by
                it instead of the micro-batch mean (pass the whole batch's count, e.g.
                `count_loss_tokens(labels)`, and the micro-batch losses add up to the
                batch mean).
            output_router_logits: MoE models: compute HF's router load-balancing loss
                (`.aux_loss`, added to `.loss` with `router_aux_loss_coef`); None takes the
                config's `output_router_logits`.
            return_logits: Whether the output has logits. None: yes, except where a loss is
                taken under autograd (the fused last stage of `forward_backward`, plain
                training), so training never builds the (tokens, vocab) tensor; pass True
                to get them there too. Without `labels` an explicit value keeps the
                original bare outputs: True gives the logits tensor, False the
                `(normed_hidden_states, lm_head_weight)` pair for `causal_lm_loss`.
        """
        for name, value in unsupported.items():
            if name not in _INERT_ARGUMENTS:
                raise ConfigError(
                    f"unexpected argument {name!r} for a RoundPipe preset model; it takes "
                    "input_ids, attention_mask, position_ids, labels, inputs_embeds, "
                    "logits_to_keep, return_dict, num_items_in_batch, output_router_logits "
                    "and return_logits"
                )
            if value:
                raise ConfigError(
                    f"{name}={value!r} is not supported by RoundPipe presets (no KV cache, "
                    "no per-layer outputs); leave it unset"
                )
        if (input_ids is None) == (inputs_embeds is None):
            raise ConfigError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is not None:
            if inputs_embeds.dim() != 3:
                raise ConfigError(
                    "inputs_embeds must be (batch, seq, hidden), got shape "
                    f"{tuple(inputs_embeds.shape)}"
                )
            hidden = inputs_embeds
        else:
            assert input_ids is not None
            if input_ids.dim() != 2:
                raise ConfigError(
                    f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}"
                )
            hidden = self.embed_tokens(input_ids)
        if labels is not None and labels.shape != hidden.shape[:2]:
            raise ConfigError(
                f"labels must be (batch, seq) like the input, got shape {tuple(labels.shape)} "
                f"for an input of {tuple(hidden.shape[:2])}"
            )
        router_stats = None
        want_router = False
        # The original bare outputs (see return_logits) have no room for an aux loss: the
        # config's default does not apply to them.
        bare = labels is None and return_logits is not None and return_dict is None
        if self.moe is not None:
            want_router = (
                self.moe.output_router_logits and not bare
                if output_router_logits is None
                else bool(output_router_logits)
            )
            if want_router:
                router_stats = zero_router_stats(self.moe.num_experts, hidden.device)
        options = HeadOptions(
            return_logits=return_logits,
            logits_to_keep=logits_to_keep,
            return_dict=return_dict,
            num_items_in_batch=num_items_in_batch,
            output_router_logits=want_router,
        )
        return (hidden, attention_mask, position_ids, labels, router_stats, options)


def _config_digest(config: Any) -> str:
    """A digest of a HF config's values (equal configs, equal digests)."""
    import hashlib

    values = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    return hashlib.sha1(repr(sorted(values.items(), key=str)).encode()).hexdigest()


def zero_router_stats(num_experts: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Empty sums for HF's load-balancing loss: top-k counts and routing probabilities per
    expert, and the number of routed rows (int64 counts stay exact at any size)."""
    return (
        torch.zeros(num_experts, dtype=torch.int64, device=device),
        torch.zeros(num_experts, dtype=torch.float32, device=device),
        torch.zeros((), dtype=torch.int64, device=device),
    )


def layer_is_sliding(config: Any, layer_idx: int) -> bool:
    """Whether HF gives decoder layer `layer_idx` the sliding-window causal mask.

    Families with `config.layer_types` (Qwen2, Qwen3, GPT-OSS) name it per layer; the
    others (Mistral, Qwen3-MoE) use it for every layer when `config.sliding_window` is set.
    """
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[layer_idx] == "sliding_attention"
    return getattr(config, "sliding_window", None) is not None


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
        # What the default positions' cos/sin depend on (None: recompute them every call).
        self.rotary_key = rotary_fingerprint(rotary_emb)
        self.config = config
        self.sliding = layer_is_sliding(config, layer_idx)
        # Set by the preset (engine.models.DISABLE_TORCH_COMPILE); read-only in forward.
        self.use_compile = False
        # Set by the preset (to_sequential's recompute_attention); read-only in forward.
        self.recompute_attention = False
        from . import MLP_CHUNK_TOKENS  # the package imports this module first

        # Micro-batches of more tokens than this run the MLP half in chunks of
        # `mlp_chunk_size` tokens (None: never); see `_run_chunked`.
        self.mlp_chunk_tokens: int | None = MLP_CHUNK_TOKENS
        self.mlp_chunk_size = DEFAULT_MLP_CHUNK_SIZE
        # Whether the HF layer is the pre-norm attention + dense MLP pair that
        # `_attention_half` and `_mlp_half` reproduce.
        self.mlp_chunkable = self.mlp_is_dense and has_split_halves(layer)
        attention = getattr(layer, "self_attn", None)
        # Whether the attention can skip its recompute (see _attention): HF "sdpa" only.
        self.attention_routed = attention is not None and route_attention(attention)
        # Memos of `_causal_mask` (plain calls whose mask is None) and `_draws_random`.
        self._no_mask: dict[tuple[Any, ...], bool] = {}
        self._random_in_mode: dict[bool, bool] = {}
        # What makes two decoder layers compute the same function (engine.accel.graphs shares a
        # graph between layers with equal keys): the classes and the model's config.
        self._replay_identity = (
            type(self).__qualname__,
            type(layer).__qualname__,
            _config_digest(config),
        )
        heads = config.num_attention_heads
        self.attention_shape = (
            heads,
            getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads,
        )

    # Whether the layer may run under torch.compile (False where routing is data-dependent).
    compilable = True
    # Whether `layer.mlp` treats tokens alike (False for mixture-of-experts routers, whose
    # statistics and capacity see the whole micro-batch): only then may it run chunked.
    mlp_is_dense = True
    # Whether the caller's position_ids reach HF's mask builder (as the HF model passes them).
    mask_uses_position_ids = True

    def forward(self, carry: Carry) -> Carry:
        """Run the decoder layer on the carry's hidden states; pass the rest along."""
        hidden, attention_mask, position_ids, *rest = carry
        out = self.run_layer(hidden, attention_mask, position_ids)
        return (out, attention_mask, position_ids, *rest)  # type: ignore[return-value]

    def run_layer(
        self, hidden: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None
    ) -> Tensor:
        """The HF decoder layer on (mb, seq, hidden) states, with its mask and rotary."""
        if position_ids is None:
            positions, position_embeddings = default_rotary(
                self.rotary_key, self.rotary_emb, hidden
            )
        else:
            positions = position_ids
            position_embeddings = tuple(self.rotary_emb(hidden, positions))
        mask = self._causal_mask(hidden, attention_mask, position_ids)
        # Compiled only for half precision on CUDA: fp32 models keep plain PyTorch's exact
        # numerics (inductor's fused kernels differed by ~4e-4 relative in an fp32 test on
        # the H100, unexplained yet), far below fp16/bf16 resolution.
        compiled = self.use_compile and self.compilable and hidden.is_cuda and hidden.dtype in _HALF
        args = (self.layer, hidden, mask, positions, *position_embeddings)
        mode = self._attention_mode(hidden, mask)
        if self._chunks_mlp(hidden):
            return self._run_chunked(args, mode, compiled)
        if mode == "save":
            call = _compiled_saving_call() if compiled else _decoder_call_saving_attention
            out, attn_out, attn_lse = call(*args)
            save_for_recompute(attn_out, attn_lse)
        else:
            call = _compiled_decoder_call() if compiled else _decoder_call
            out = call(*args, recompute_data_or_none() if mode == "replay" else None)
        return out

    def _causal_mask(
        self, hidden: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None
    ) -> Any:
        """The mask HF's attention gets for this call (None: plain causal attention).

        The caller's position_ids (not the default arange) go to the mask builder: only they
        can describe packing, and HF's packing check costs a host sync. A window that covers
        the whole sequence (every causal key is within it) is plain causal attention; HF
        still builds a sliding mask when the two are equal (its skip test is
        `length < window`), which would keep the layer off the cuDNN kernels. Without a
        padding mask or positions the answer depends only on the length and the dtype: it
        is asked of transformers once, so neither every call nor a CUDA graph capture (where
        transformers builds masks it would skip otherwise) runs the mask builder.
        """
        window = getattr(self.config, "sliding_window", None)
        covered = window is not None and hidden.shape[1] <= window
        sliding = self.sliding and not covered
        plain = attention_mask is None and (position_ids is None or not self.mask_uses_position_ids)
        key = (hidden.shape[1], hidden.dtype, hidden.device.type, sliding)
        if plain and self._no_mask.get(key):
            return None
        mask = build_causal_mask(
            self.config,
            hidden,
            attention_mask,
            position_ids if self.mask_uses_position_ids else None,
            sliding=sliding,
        )
        if plain and mask is None:
            self._no_mask[key] = True
        return mask

    def _draws_random(self) -> bool:
        """Whether the layer's training-mode dropout draws random numbers."""
        training = self.layer.training
        known = self._random_in_mode.get(training)
        if known is None:
            known = any(
                m.training
                and (
                    (isinstance(m, nn.Dropout) and m.p > 0)
                    or float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0
                )
                for m in self.layer.modules()
            )
            self._random_in_mode[training] = known
        return known

    def rp_replay_key(self, carry: Carry) -> tuple[Any, ...] | None:
        """What this call depends on besides its tensors' values, where it may be replayed
        as a CUDA graph (engine.accel.graphs); None where it runs as it is.

        Replayed: the compiled half-precision CUDA path on plain causal attention (no
        padding mask, no positions, no sliding window shorter than the sequence), without
        dropout, MLP chunking or router statistics; the attention saved or replayed as in
        any call.
        """
        hidden, attention_mask, position_ids, _, router_stats, _ = carry
        if attention_mask is not None or position_ids is not None or router_stats is not None:
            return None
        if not (self.use_compile and self.compilable and hidden.is_cuda and hidden.dtype in _HALF):
            return None
        if self._chunks_mlp(hidden) or self._draws_random():
            return None
        if self._causal_mask(hidden, None, None) is not None:
            return None
        return (
            self._replay_identity,
            self.sliding,
            self._attention_mode(hidden, None),
            tuple(hidden.shape),
            hidden.dtype,
            hidden.device,
            torch.is_grad_enabled(),
        )

    def _chunks_mlp(self, hidden: Tensor) -> bool:
        """Whether this micro-batch runs the MLP half chunk by chunk."""
        limit = self.mlp_chunk_tokens
        return (
            self.mlp_chunkable and limit is not None and hidden.shape[0] * hidden.shape[1] > limit
        )

    def _run_chunked(self, args: tuple[Any, ...], mode: str | None, compiled: bool) -> Tensor:
        """The layer as HF runs it, with the MLP half over token chunks.

        Under grad each chunk runs under `torch.utils.checkpoint`: autograd keeps only the
        chunk's input (a view of the attention half's output, which the post-attention
        norm would keep anyway) and recomputes the chunk's MLP in the backward, so no
        (tokens, intermediate) tensor of the whole micro-batch is ever alive. Under no_grad
        the chunks just run one after the other. The attention half keeps the saved
        attention slot ("save"/"replay", see `_attention_mode`) exactly as the whole layer
        does. The checkpoint stays outside the compiled functions (dynamo would have to
        trace it); each compiled body is an ordinary autograd function to it.
        """
        if mode == "save":
            call = _compiled_attention_half_saving() if compiled else _attention_half_saving
            hidden, attn_out, attn_lse = call(*args)
            save_for_recompute(attn_out, attn_lse)
        else:
            call = _compiled_attention_half() if compiled else _attention_half
            hidden = call(*args, recompute_data_or_none() if mode == "replay" else None)
        body = _compiled_mlp_half() if compiled else _mlp_half
        layer = args[0]
        flat = hidden.reshape(-1, hidden.shape[-1])  # (tokens, hidden)
        grad = torch.is_grad_enabled()
        parts = []
        for start in range(0, flat.shape[0], self.mlp_chunk_size):
            # Every chunk but the last has mlp_chunk_size rows: under torch.compile
            # (dynamic=False, one graph per shape) that is at most two graphs per grad mode.
            piece = flat[start : start + self.mlp_chunk_size]
            if grad:
                parts.append(checkpoint(body, layer, piece, use_reentrant=False))
            else:
                parts.append(body(layer, piece))
        return torch.cat(parts).view(hidden.shape)

    def _attention_mode(self, hidden: Tensor, mask: Any) -> str | None:
        """'save' (a forward that will be recomputed), 'replay' (that recompute) or None.

        Only plain causal attention (no mask, dropout or sliding window) in half precision
        on CUDA, where the cuDNN kernels run.
        """
        if (
            self.recompute_attention
            or not self.attention_routed
            or mask is not None
            or not hidden.is_cuda
            or hidden.dtype not in _HALF
        ):
            return None
        attention = self.layer.self_attn
        # A sliding window at least as long as the sequence is plain causal attention.
        window = getattr(self.config, "sliding_window", None)
        windowed = self.sliding or getattr(attention, "sliding_window", None) is not None
        if (windowed and (window is None or hidden.shape[1] > window)) or (
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


def has_split_halves(layer: nn.Module) -> bool:
    """Whether `layer` is HF's pre-norm decoder layer with a dense gated MLP.

    That is Llama's layer, which Qwen2, Qwen3 and Mistral repeat: exactly the children
    `input_layernorm`, `self_attn`, `post_attention_layernorm` and `mlp`, the MLP holding
    `gate_proj`, `up_proj` and `down_proj` (nn.Linear, or LoRA's wrappers of them) and its
    activation. Layers with other norms around the MLP (Gemma, OLMo-2) or a router differ
    in their children and are run whole.
    """
    children = {name for name, _ in layer.named_children()}
    if children != {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}:
        return False
    mlp_children = {name for name, _ in layer.mlp.named_children()}
    projections = {"gate_proj", "up_proj", "down_proj"}
    return projections <= mlp_children <= projections | {"act_fn"}


def _attention_half(
    layer: nn.Module,
    hidden: Tensor,
    mask: Tensor | None,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    attention: Any = None,
) -> Tensor:
    """The first half of the HF decoder layer: hidden + self_attn(input_layernorm(hidden)).

    The attention gets the arguments HF's decoder layer gives it (transformers 5.x
    Llama/Qwen2/Qwen3/Mistral: no cache, so `past_key_values=None`, `use_cache=False`),
    plus the attention slot (see `_decoder_call`).
    """
    kwargs = {} if attention is None else {SLOT_KWARG: attention}
    out = layer.self_attn(
        hidden_states=layer.input_layernorm(hidden),
        attention_mask=mask,
        position_ids=positions,
        past_key_values=None,
        use_cache=False,
        position_embeddings=(cos, sin),
        **kwargs,
    )
    return hidden + out[0]


def _attention_half_saving(
    layer: nn.Module,
    hidden: Tensor,
    mask: Tensor | None,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """`_attention_half` that also returns the attention output and log-sum-exp."""
    slot: list[Tensor] = []
    out = _attention_half(layer, hidden, mask, positions, cos, sin, slot)
    return out, slot[0], slot[1]


def _mlp_half(layer: nn.Module, hidden: Tensor) -> Tensor:
    """The second half of the HF decoder layer on (tokens, hidden) states: it treats every
    token alike, so it runs on any chunk of them."""
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


@functools.cache
def _compiled_decoder_call() -> Callable[..., Tensor]:
    """`_decoder_call` under torch.compile, shared by every layer and device.

    The layer is an argument, not a compiled module: the engine runs device-side replicas
    of each layer, and torch.compile lifts their parameters as graph inputs, so all
    decoder layers of one shape share one compiled graph (one for grad, one for no-grad).
    It fuses HF's fp32 RMSNorm, rotary and SwiGLU elementwise work (the step's GPU time
    it saved: bench/RESULTS.md).
    """
    return compile_for_devices(_decoder_call)


@functools.cache
def _compiled_saving_call() -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """`_decoder_call_saving_attention` under torch.compile (see `_compiled_decoder_call`)."""
    return compile_for_devices(_decoder_call_saving_attention)


@functools.cache
def _compiled_attention_half() -> Callable[..., Tensor]:
    """`_attention_half` under torch.compile (see `_compiled_decoder_call`)."""
    return compile_for_devices(_attention_half)


@functools.cache
def _compiled_attention_half_saving() -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """`_attention_half_saving` under torch.compile (see `_compiled_decoder_call`)."""
    return compile_for_devices(_attention_half_saving)


@functools.cache
def _compiled_mlp_half() -> Callable[..., Tensor]:
    """`_mlp_half` under torch.compile: one chunk's norm, SwiGLU and residual fused."""
    return compile_for_devices(_mlp_half)


class LMHeadLayer(nn.Module):
    """Last layer: final norm, then HF's causal-LM output (`.loss`, `.logits`, `.aux_loss`).

    With `labels`, `.loss` is taken by the chunked cross-entropy straight from the normed
    hidden states (no (tokens, vocab) logits for it) and is HF's loss of this micro-batch;
    `.logits` are computed only where they are returned (see `EmbeddingLayer`'s
    `return_logits`).
    """

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, moe: MoeInfo | None = None) -> None:
        super().__init__()
        if lm_head.bias is not None:
            raise NotImplementedError(
                "the causal-LM head preset supports lm_head without bias only"
            )
        self.norm = norm
        self.lm_head = lm_head
        self.moe = moe
        self.loss_chunk_tokens = DEFAULT_LOSS_CHUNK_TOKENS

    def forward(self, carry: Carry) -> Any:
        """Return the HF output object (a tuple with return_dict=False), or, for an
        explicit `return_logits` without labels, the logits or the training pair."""
        from ._outputs import (
            CausalLMOutput,
            LossSpec,
            MoeCausalLMOutput,
            OutputTuple,
            build_output,
        )

        hidden, _, _, labels, router_stats, options = carry
        hidden = self.norm(hidden)
        if (
            labels is None
            and router_stats is None
            and options.return_logits is not None
            and options.return_dict is None
        ):
            if options.return_logits:
                return self.lm_head(_keep_positions(hidden, options.logits_to_keep))
            return (hidden, self.lm_head.weight)
        want_logits = options.return_logits
        if want_logits is None:
            # Left out only where a loss is taken right here under autograd (the fused last
            # stage of forward_backward, plain use); a no-grad forward and its recompute
            # must agree on the output's structure, so both keep them.
            want_logits = labels is None or not torch.is_grad_enabled() or doing_recompute()
        parts: dict[str, Tensor] = {}
        ce_mode = None
        if labels is not None:
            targets = shift_labels(labels, IGNORE_INDEX).reshape(-1)
            total = chunked_cross_entropy_sum(
                hidden.reshape(-1, hidden.shape[-1]),
                self.lm_head.weight,
                targets,
                chunk_tokens=self.loss_chunk_tokens,
            )
            items = options.num_items_in_batch
            if items is None:
                ce_mode = "mean"
                parts["ce_sum"] = total.reshape(1)
                parts["ce_count"] = (targets != IGNORE_INDEX).sum().reshape(1)
            else:
                ce_mode = "items"
                if isinstance(items, Tensor):
                    items = items.to(total.device)
                parts["ce_loss"] = (total / items).reshape(1)
        spec = LossSpec(ce_mode)
        if router_stats is not None:
            assert self.moe is not None
            counts, probs, rows = router_stats
            parts["router_counts"] = counts.unsqueeze(0)
            parts["router_probs"] = probs.unsqueeze(0)
            parts["router_rows"] = rows.reshape(1)
            spec = LossSpec(ce_mode, self.moe.num_experts, self.moe.aux_coef)
        fields: dict[str, Any] = {}
        if want_logits:
            fields["logits"] = self.lm_head(_keep_positions(hidden, options.logits_to_keep))
        cls = CausalLMOutput if self.moe is None else MoeCausalLMOutput
        out = build_output(cls, fields, parts or None, spec if parts else None)
        return OutputTuple.of(out) if options.return_dict is False else out


def _keep_positions(hidden: Tensor, logits_to_keep: int | Tensor) -> Tensor:
    """HF's `logits_to_keep`: the last N positions (0: all), or the given positions."""
    if isinstance(logits_to_keep, int):
        return hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:, :]
    return hidden[:, logits_to_keep.to(hidden.device), :]


def build_causal_lm_sequential(
    model: nn.Module,
    *,
    decoder_cls: Callable[..., DecoderLayer] | None = None,
    moe: MoeInfo | None = None,
) -> nn.Sequential:
    """Return the `nn.Sequential` of a HF `*ForCausalLM` with the usual `model.*` layout.

    The layout is `model.model.{embed_tokens, layers, norm, rotary_emb}` and `model.lm_head`
    (Qwen2/2.5, Qwen3, Qwen3-MoE, Llama, Mistral, GPT-OSS). The HF modules are reused, not
    copied.

    Args:
        decoder_cls: Makes the decoder-layer wrapper from `(layer, rotary_emb, config,
            layer_idx)` (default `DecoderLayer`; MoE families pass one that also sums the
            router statistics).
        moe: For mixture-of-experts families: what the router auxiliary loss needs.
    """
    base = model.model
    config = model.config
    make_decoder = decoder_cls or DecoderLayer
    layers: list[nn.Module] = [EmbeddingLayer(base.embed_tokens, moe)]
    num_layers = getattr(config, "num_hidden_layers", len(base.layers))
    for idx, layer in enumerate(list(base.layers)[:num_layers]):
        layers.append(make_decoder(layer, base.rotary_emb, config, idx))
    layers.append(LMHeadLayer(base.norm, model.lm_head, moe))
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
