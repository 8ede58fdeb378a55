"""One HF decoder layer as a preset layer: its rotary embedding and causal mask built on
the device, the carry (`_carry`) passed on.

How a call runs is decided here and done elsewhere: the attention slot (`_attention`), the
whole layer in one call (`_layer_calls`) or its MLP half over token chunks (`_mlp_chunks`),
and whether the call may be replayed as a CUDA graph (`_replay`).
"""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor, nn

from ._attention import attention_mode, route_attention
from ._carry import Carry
from ._compile import HALF_DTYPES
from ._layer_calls import run_whole
from ._mask import build_causal_mask, layer_is_sliding
from ._mlp_chunks import DEFAULT_MLP_CHUNK_SIZE, has_split_halves, run_chunked
from ._replay import replay_identity, replay_key
from ._rotary import default_rotary, rotary_fingerprint

__all__ = ["DecoderLayer"]


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
        from . import MLP_CHUNK_TOKENS  # read per layer built: set before wrapping, it applies

        # Micro-batches of more tokens than this run the MLP half in chunks of
        # `mlp_chunk_size` tokens (None: never); see `_mlp_chunks`.
        self.mlp_chunk_tokens: int | None = MLP_CHUNK_TOKENS
        self.mlp_chunk_size = DEFAULT_MLP_CHUNK_SIZE
        # Whether the HF layer is the pre-norm attention + dense MLP pair that
        # `_mlp_chunks` splits in two.
        self.mlp_chunkable = self.mlp_is_dense and has_split_halves(layer)
        attention = getattr(layer, "self_attn", None)
        # Whether the attention can skip its recompute (see _attention): HF "sdpa" only.
        self.attention_routed = attention is not None and route_attention(attention)
        # Memos of `causal_mask` (plain calls whose mask is None) and `draws_random`.
        self._no_mask: dict[tuple[Any, ...], bool] = {}
        self._random_in_mode: dict[bool, bool] = {}
        # engine.accel.graphs shares a graph between layers with equal keys (see _replay).
        self.replay_identity = replay_identity(self, layer, config)
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
        mask = self.causal_mask(hidden, attention_mask, position_ids)
        # Compiled only for half precision on CUDA: fp32 models keep plain PyTorch's exact
        # numerics (inductor's fused kernels differed by ~4e-4 relative in an fp32 test on
        # the H100, unexplained yet), far below fp16/bf16 resolution.
        compiled = (
            self.use_compile and self.compilable and hidden.is_cuda and hidden.dtype in HALF_DTYPES
        )
        args = (self.layer, hidden, mask, positions, *position_embeddings)
        mode = attention_mode(self, hidden, mask)
        if self.chunks_mlp(hidden):
            return run_chunked(args, mode, compiled, self.mlp_chunk_size)
        return run_whole(args, mode, compiled)

    def causal_mask(
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

    def draws_random(self) -> bool:
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
        as a CUDA graph (engine.accel.graphs); None where it runs as it is (see `_replay`)."""
        return replay_key(self, carry)

    def chunks_mlp(self, hidden: Tensor) -> bool:
        """Whether this micro-batch runs the MLP half chunk by chunk."""
        limit = self.mlp_chunk_tokens
        return (
            self.mlp_chunkable and limit is not None and hidden.shape[0] * hidden.shape[1] > limit
        )
