"""Rollouts whose decode step is one CUDA graph: the resident copy's step captured, replayed.

Why: the eager loop (`generation.RolloutSampler._decode`) launches every kernel of every
layer from Python through transformers' forward, and at GRPO's batch the host is what a
token waits on. Session 26 profiled Qwen3-8B with LoRA r16, 256 rows, on an H200: a decode
step held the host for 62 ms against 19 ms of GPU kernels (32 ms a step with the adapters
off), so a 512-token rollout batch took 43 s. Replayed, a step costs its kernels.

How: the copy's own modules run (the embeddings, the rotary table, each decoder layer,
the final norm, the head), not the model's `forward`, whose mask building and cache
bookkeeping read values back to the host, which a capture forbids. Around them:
- `_StaticCache`, the KV cache each attention layer writes through `update`: per layer
  (rows, KV heads, length, head dim), zero beyond what was written (a masked column's
  weight is 0, and 0 times a stale NaN would be NaN), written at a position held in a
  device tensor;
- a boolean mask over the cache's whole length, (rows, 1, 1, length), and the tokens and
  positions in fixed buffers, all changed in place between replays.
The prompts are prefilled eagerly (left-padded to the job's longest prompt, a causal mask
with the padding; a padding query that would see nothing sees every prompt column, as
transformers' SDPA mask does, so no NaN reaches the cache). The first decode step runs
eagerly twice on a side stream (cuBLAS and cuDNN set up outside the capture; both write the
K/V the replay writes again), is captured, and replayed; the second step is computed
eagerly as well as replayed, and the two must agree, else the batch goes back to the eager
loop. Rows that finish stay in the graph's batch and their tokens are ignored, until at
most half the rows still decode: then the live ones move to the front (their cache rows
too, in place) and the step is captured again for that many (`GraphDecoder._compact`). The
draw, as in the eager loop, is over the active rows only, so both loops consume the same
numbers of the job's seeded generator in the same order.

Where: a copy on a GPU (resident or uploaded per step) of a dense decoder family whose
attention layers call `update` on the cache they are given, with SDPA attention and no
sliding window (`_FAMILIES`); else the eager loop. RP_GRAPH_ROLLOUTS=0 turns it off,
"force" runs the same static step on the CPU uncaptured (tests: the tokens equal the eager
loop's). Any exception decodes the batch again with the eager loop, and the sampler stays
eager. The decoder (cache, graph) lives for one step's rollouts: `RolloutSampler.step_done`
drops it, so training has that memory back (the KV cache and the graph's pool).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .sampling import Draw

if TYPE_CHECKING:
    from .generation import Decoding

__all__ = ["GraphDecoder", "graph_decoding_wanted", "unsupported_reason"]

log = logging.getLogger(__name__)

# Decoder families whose layers take (hidden, mask, positions, rotary table, cache) and whose
# attention writes the cache through `update` (transformers' Llama layout).
_FAMILIES = frozenset({"qwen3", "qwen2", "llama", "mistral"})
# How far the replayed logits may sit from the eager step's, relative to their largest;
# it only catches a capture that went wrong (stale inputs, freed memory: errors of the
# logits' own size). The same code replayed is not the same arithmetic: under capture
# cuBLAS may take other GEMM algorithms, so half precision drifts through the layers. A
# random-weight Qwen3-8B in bf16 with LoRA (bench/grpo.py, one H200) sat 0.035 away, which
# the first bound, 1e-2 for every dtype, refused; fp32 copies stay far under 1e-2.
_AGREEMENT = {torch.float32: 1e-2, torch.float64: 1e-2}
_HALF_AGREEMENT = 0.1


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `model`'s decode step cannot be replayed here, or None where it can."""
    from .streamed_generation import decoder_layers

    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in _FAMILIES:
        return f"model type {kind!r} is not one of {sorted(_FAMILIES)}"
    attention = getattr(config, "_attn_implementation", None)
    if attention != "sdpa":
        return f"attention {attention!r}: the static mask is SDPA's (boolean)"
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    window = getattr(config, "sliding_window", None) if kind == "mistral" else None
    if kinds != {"full_attention"} or window is not None:
        return "sliding-window attention: the static mask covers full attention only"
    if not decoder_layers(model) or not hasattr(getattr(model, "model", None), "rotary_emb"):
        return "no model.model.layers / rotary_emb"
    return None


def graph_decoding_wanted(model: nn.Module, device: torch.device) -> bool:
    """Whether a sampler copy of `model` on `device` replays its decode step: on a GPU
    where the model's family allows it, unless RP_GRAPH_ROLLOUTS=0 ("force": on the CPU
    too, uncaptured, for tests)."""
    setting = os.environ.get("RP_GRAPH_ROLLOUTS", "1")
    if setting == "0":
        return False
    reason = unsupported_reason(model)
    if reason is not None:
        log.info("rollouts decode eagerly: %s", reason)
        return False
    return setting == "force" or device.type == "cuda"


class _StaticCache:
    """The KV cache the attention layers write through `update`: per layer index, keys and
    values (rows, KV heads, `length`, head dim), made at the prefill (zeros). The prefill
    writes its `width` columns and attends over them; a decode step writes the column at
    `position` and attends over all `length` (the mask hides the rest)."""

    def __init__(self, length: int, position: Tensor) -> None:
        self.length = length
        self.position = position  # (1,) long on the device: where a decode step writes
        self.rows: int | None = None  # the first rows in use (None: all): GraphDecoder._compact
        self.prefill_width: int | None = None
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.updates = 0

    def update(self, keys: Tensor, values: Tensor, layer_idx: int, *_: Any, **__: Any) -> Any:
        self.updates += 1
        if self.prefill_width is not None:
            width = self.prefill_width
            if layer_idx not in self.keys:
                shape = (*keys.shape[:2], self.length, keys.shape[-1])
                self.keys[layer_idx] = keys.new_zeros(shape)
                self.values[layer_idx] = values.new_zeros(shape)
            k, v = self.keys[layer_idx], self.values[layer_idx]
            k[:, :, :width].copy_(keys)
            v[:, :, :width].copy_(values)
            return k[:, :, :width], v[:, :, :width]
        k, v = self.keys[layer_idx][: self.rows], self.values[layer_idx][: self.rows]
        k.index_copy_(2, self.position, keys)
        v.index_copy_(2, self.position, values)
        return k, v


def _prefill_mask(mask: Tensor) -> Tensor:
    """(rows, 1, width, width) booleans from a (rows, width) left-padding mask: causal, real
    columns only; a query row that would see no column (a padding position left of its
    prompt) sees every one, so its output, and the cache it writes, stay finite."""
    width = mask.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=mask.device).tril()
    allowed = causal.unsqueeze(0) & mask.bool().unsqueeze(1)
    allowed |= ~allowed.any(dim=-1, keepdim=True)
    return allowed.unsqueeze(1)


class GraphDecoder:
    """Decodes batches of `rows` prompts left-padded to `width` with at most `new_tokens`
    tokens each through `model`'s modules and a static cache; `capture`: the decode step
    replayed as a CUDA graph (else run eagerly, as on the CPU)."""

    # Rows below which a batch is no longer compacted: the step then costs about the weights'
    # reads whatever the rows, and each compaction captures the step again.
    min_rows = 16

    def __init__(
        self, model: nn.Module, *, rows: int, width: int, new_tokens: int, capture: bool
    ) -> None:
        from .generation import _cache_keyword
        from .streamed_generation import decoder_layers

        self.inner: Any = model.model
        self.layers = decoder_layers(model)
        self.head: Any = model.get_output_embeddings()
        self.capacity, self.width, self.new_tokens = rows, width, new_tokens
        self.capture = capture
        device = next(model.parameters()).device
        self.device = device
        length = width + new_tokens
        # The step's inputs, whole; `tokens`, `positions`, `mask` are views of their first
        # `rows` rows (all of them until a compaction)
        self._tokens = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self._positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self._mask = torch.zeros((rows, 1, 1, length), dtype=torch.bool, device=device)
        self.cache = _StaticCache(length, torch.zeros(1, dtype=torch.long, device=device))
        self._cache_kw = _cache_keyword(self.layers[0])
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_rows = 0  # the rows the graph was captured for
        self.logits: Tensor | None = None  # the graph's output
        self.checked = False
        self.replays = 0
        self.compactions = 0
        self.captures = 0
        self.capture_s = 0.0  # the captures' wall time, their warm-up steps included
        self._use_rows(rows)

    def counters(self) -> dict[str, float]:
        """What this decoder did so far: captures (and their seconds), replays, compactions."""
        return {
            "captures": self.captures,
            "capture_s": self.capture_s,
            "replays": self.replays,
            "compactions": self.compactions,
        }

    def fits(self, rows: int, width: int, new_tokens: int) -> bool:
        return (rows, width, new_tokens) == (self.capacity, self.width, self.new_tokens)

    def _use_rows(self, rows: int) -> None:
        """Decode the first `rows` rows from now on (a graph of another size goes)."""
        self.rows = rows
        self.tokens = self._tokens[:rows]
        self.positions = self._positions[:rows]
        self.mask = self._mask[:rows]
        self.cache.rows = rows
        if self.graph_rows != rows:
            self.graph, self.logits, self.checked = None, None, False

    def _compact(self, keep: list[int]) -> None:
        """Move rows `keep` (ascending places in the batch) to the front, in order, and
        decode those only: at half the rows a step reads half the KV cache and does half the
        arithmetic. In place (a row's new place is at or before its old one), one layer's
        rows at a time, so no second cache is made."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        n = len(keep)
        for whole in (self._tokens, self._positions, self._mask):
            whole[:n].copy_(whole.index_select(0, index))
        for tensors in (self.cache.keys, self.cache.values):
            for t in tensors.values():
                t[:n].copy_(t.index_select(0, index))
        self.compactions += 1
        self._use_rows(n)

    def _forward(self, ids: Tensor, mask: Tensor, positions: Tensor) -> Tensor:
        """The last position's logits, as the model's forward with `logits_to_keep=1`."""
        hidden = self.inner.embed_tokens(ids)
        rotary = self.inner.rotary_emb(hidden, positions)
        for layer in self.layers:
            out = layer(
                hidden,
                attention_mask=mask,
                position_ids=positions,
                position_embeddings=rotary,
                use_cache=True,
                **{self._cache_kw: self.cache},
            )
            hidden = out[0] if isinstance(out, tuple) else out
        hidden = self.inner.norm(hidden)
        return self.head(hidden[:, -1:, :])[:, -1]

    def _prefill(self, ids: Tensor, mask: Tensor) -> Tensor:
        width = ids.shape[1]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self.cache.prefill_width = width
        before = self.cache.updates
        try:
            logits = self._forward(ids, _prefill_mask(mask), positions)
        finally:
            self.cache.prefill_width = None
        if self.cache.updates - before != len(self.layers):
            raise RuntimeError(
                f"{self.cache.updates - before} cache updates for {len(self.layers)} layers: "
                "the attention does not write the cache it is given"
            )
        self._use_rows(self.capacity)
        self.mask.zero_()
        self.mask[:, 0, 0, :width] = mask.bool()
        self.positions.copy_(positions[:, -1:])
        self.cache.position.fill_(width - 1)
        return logits

    def _step(self) -> Tensor:
        """The next token's logits, (rows, vocab): one column further, replayed."""
        self.positions.add_(1)
        self.cache.position.add_(1)
        self.mask.index_fill_(3, self.cache.position, True)
        if not self.capture:
            return self._forward(self.tokens, self.mask, self.positions)
        if self.graph is None:
            return self._capture()
        self.replays += 1
        if self.checked:
            self.graph.replay()
            return self.logits  # type: ignore[return-value]
        eager = self._forward(self.tokens, self.mask, self.positions)
        self.graph.replay()
        replayed = self.logits
        assert replayed is not None
        if not bool(torch.isfinite(replayed).all()):
            raise RuntimeError("the replayed decode step gave non-finite logits")
        scale = eager.float().abs().amax().clamp(min=1e-6)
        off = float((eager.float() - replayed.float()).abs().amax() / scale)
        bound = _AGREEMENT.get(eager.dtype, _HALF_AGREEMENT)
        if off > bound:
            raise RuntimeError(
                f"the replayed decode step is {off:.3g} from the eager one (bound {bound:g} "
                f"for {eager.dtype})"
            )
        log.info("replayed decode step checked: %.3g from the eager one (%s)", off, eager.dtype)
        self.checked = True
        return replayed

    def _capture(self) -> Tensor:
        start = time.perf_counter()
        args = (self.tokens, self.mask, self.positions)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # set-up outside the capture; writes the K/V replays write
                self._forward(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine's own threads may use CUDA meanwhile (legal for them)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.logits = self._forward(*args)
        self.graph, self.graph_rows = graph, self.rows
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        graph.replay()
        return self.logits

    def decode(
        self,
        batch: Decoding,
        *,
        draw: Draw | None,
        max_new_tokens: int,
        stop: set[int],
        max_positions: int,
        pad_id: int,
    ) -> None:
        """Decode `batch`'s rows (as many as this decoder's `capacity`), filling its `made`,
        `stops` and `finish` as the eager loop does. Once at most half the rows still decode
        (and at least `min_rows`), they are compacted to the front and the step is captured
        again for that many."""
        ids, mask = batch.left_padded(pad_id, self.width)
        logits = self._prefill(ids.to(self.device), mask.to(self.device))
        rows = list(batch.rows)  # the batch's rows still decoding
        active = list(range(self.rows))  # their places in the decoder's batch
        index: Tensor | None = None  # `active` on the device, once rows have left
        limits = {"stop": stop, "max_new_tokens": max_new_tokens, "max_positions": max_positions}
        while True:
            scores = logits if index is None else logits.index_select(0, index)
            chosen, keep = batch.choose_next(rows, scores, draw, **limits)
            if not keep:
                return
            if index is None:
                self.tokens[:, 0] = chosen
            else:
                self.tokens.index_copy_(0, index, chosen.view(-1, 1))
            if len(keep) < len(rows):
                rows = [rows[r] for r in keep]
                active = [active[r] for r in keep]
                if self.min_rows <= len(active) <= self.rows // 2:
                    self._compact(active)
                    active = list(range(len(active)))
                index = (
                    None
                    if len(active) == self.rows
                    else torch.tensor(active, dtype=torch.long, device=self.device)
                )
            logits = self._step()
