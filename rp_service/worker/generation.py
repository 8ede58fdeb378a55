"""KV-cached batched generation on a device-resident copy of the model (GRPO's rollouts).

Why a copy: the trainer streams layers from host memory, so no GPU holds the whole model,
and the engine's forward keeps no KV cache (`sampling` generates through it: one forward
over the whole sequence a token). For a base that fits, `RolloutSampler` keeps one full
copy on the first engine device and decodes with transformers' own KV cache
(`DynamicCache`) through the HF model's modules, the whole batch (every prompt's group) a
step: one prefill of the left-padded prompts, then one one-token forward per step.

The copy holds the current weights: `refresh()` copies the trainable host parameters into
it (LoRA: the adapters' A and B only, the base stays; full fine-tuning: every weight), read
after the loop's `synchronize()`. An NF4 base is decoded once, at the upload, into its
half-precision dtype. The adapters run unmerged (base GEMM plus the low-rank product, as
peft computes them); the trainer's device replicas merge them into the weight, so in half
precision the two differ by a rounding of the adapter's contribution. The loss reads the
trainer's own log-probabilities, never the sampler's.

Why a decode loop here and not transformers' `generate` (which chat serving uses,
`serving/process.py`): `generate` draws on the device from torch's global generator and
keeps finished rows in the batch; rollouts must draw with the job's seeded host
generator over the active rows only, or a resumed job and the engine path would draw
other tokens. The cache itself is transformers'. This loop decodes eagerly, launching every
kernel from Python: at GRPO's batch that, not the GPU, is what a token waits on. On a GPU the
copy's decode step is replayed as a CUDA graph instead (`graph_decode`: the same modules, a
static cache, the tokens chosen as here), back to this loop if that raises.

Tokens are chosen exactly as `sampling._complete` chooses them: greedy on the device, or
`draw` over the active rows' fp32 logits (on the device; one number a row from the
caller's seeded host generator, `sampling.top_p_draw`), so a resumed job draws the same
tokens, and the two paths give the same rows for the same logits
(tests/unit/rp_service/test_generation.py checks it token for token). A row leaves the
batch (and the cache) at a stop id, at the token limit or at the model's positions.

Placement (`placement`): the copy and the largest KV cache must fit in the device's memory
(the GPU memory cap where one is set) beside what the process already holds. The copy
stays on the device between steps when the copy and the KV cache take at most half of that
memory; else it is dropped after each step's rollouts (and uploaded again at the next), so
the trainer has the device to itself while it trains. Where the copy does not fit but the
layers' weights are frozen NF4 whose packed bytes fit, they are kept packed on the device
and decoded at every forward ("packed", `streamed_generation`). Else the decoder layers are
streamed from host memory at every token (`streamed_generation`: the same decode loop, a
layer's upload each forward instead of a copy) if the modules outside the layers, two
layers and the KV cache fit; else no sampler (the job samples through the engine,
`sampling`). The order is the cost's: a resident copy uploads nothing per token, the
packed one decodes the layers, the streamed one uploads the layers' bytes, the engine those
plus a forward over the whole sequence.
"""

from __future__ import annotations

import copy
import gc
import inspect
import logging
import os
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from .sampling import Draw, Sample

__all__ = [
    "Decoding",
    "Placement",
    "RolloutSampler",
    "kv_cache_bytes",
    "make_sampler",
    "placement",
]

log = logging.getLogger(__name__)

Placement = Literal["resident", "per_step", "packed", "streamed", "none"]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Shape:
    """What a KV cache's size depends on."""

    layers: int
    kv_heads: int
    head_dim: int


def _kv_shape(config: Any) -> _Shape:
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return _Shape(
        layers=int(config.num_hidden_layers),
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
    )


def kv_cache_bytes(config: Any, *, rows: int, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a KV cache of `rows` sequences of `tokens` tokens (keys and values)."""
    shape = _kv_shape(config)
    per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim
    return per_token * rows * tokens * torch.empty(0, dtype=dtype).element_size()


def placement(
    *,
    model_bytes: int,
    kv_bytes: int,
    usable: int,
    held: int,
    streamed_bytes: int | None = None,
    packed_bytes: int | None = None,
    streamed_only: bool = False,
) -> Placement:
    """Where the sampler's weights live (see the module doc): `usable` is the device's
    memory (its cap), `held` what this process holds there already, `streamed_bytes` what a
    streamed sampler holds (`streamed_generation.streamed_device_bytes`; None: it cannot
    stream this model), `packed_bytes` what one that keeps the layers packed on the device
    holds (`packed_device_bytes`; None: not offered). `streamed_only` passes over the full
    copy and the packed layers: every layer comes over the host link at every forward."""
    free = usable - held
    need = model_bytes + kv_bytes
    if not streamed_only and need <= free:
        return "resident" if need <= usable // 2 else "per_step"
    if not streamed_only and packed_bytes is not None and packed_bytes + kv_bytes <= free:
        return "packed"
    if streamed_bytes is not None and streamed_bytes + kv_bytes <= free:
        return "streamed"
    return "none"


_WHY: dict[Placement, str] = {
    "resident": "the copy and the KV cache fit in half the device: kept between steps",
    "per_step": "the copy and the KV cache fit beside what the process holds: uploaded "
    "each step, dropped after its rollouts",
    "packed": "the decoder layers' NF4 weights kept packed on the device (uploaded once a "
    "step) and decoded two layers at a time at each token, beside the other modules and the "
    "KV cache",
    "streamed": "the decoder layers streamed from host memory each token, two at a time "
    "beside the other modules and the KV cache",
    "none": "neither the copy nor the streamed layers and the KV cache fit: through the engine",
}


def _param_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as the device holds them (an NF4 weight decoded)."""
    seen: set[int] = set()
    total = 0
    for p in list(model.parameters()) + list(model.buffers()):
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _device_value(t: Tensor, device: torch.device, *, non_blocking: bool = False) -> Tensor:
    """A copy of `t`'s value on `device`: an NF4 weight is copied packed and decoded there,
    on the current stream."""
    from engine.memory import packed_form

    packed = packed_form(t)
    if packed is not None:  # NF4: the parameter's own storage is a stand-in
        return packed.to_device(device, non_blocking=non_blocking)
    return t.detach().to(device, copy=True, non_blocking=non_blocking)


def _adapter_weights(module: nn.Module) -> tuple[Tensor, Tensor]:
    return module.lora_A.weight, module.lora_B.weight  # type: ignore[union-attr, return-value]


def _device_copy(
    host: nn.Module, device: torch.device, *, left_out: Container[int] = ()
) -> tuple[nn.Module, list[tuple[nn.Parameter, nn.Parameter]]]:
    """A deep copy of `host` in eval mode whose tensors are on `device`, and the (host,
    copy) pairs of its trainable parameters. The parameters whose ids are `left_out` get a
    meta tensor of their shape and dtype instead (a streamed layer's weights)."""
    from engine.adapters.lora import lora_modules

    memo: dict[int, Any] = {}
    trained: list[tuple[nn.Parameter, nn.Parameter]] = []
    # LoRA's fp32 A and B of a half-precision model are kept in the model's dtype: its
    # forward casts them to the activations' dtype at every call (the same values), two
    # small kernels per adapter per token saved.
    half = host.get_input_embeddings().weight.dtype
    lora_ids = {id(w) for _, m in lora_modules(host) for w in _adapter_weights(m)}
    for p in host.parameters():
        if id(p) in memo:
            continue
        if id(p) in left_out:
            memo[id(p)] = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False
            )
            continue
        value = _device_value(p, device)
        if id(p) in lora_ids and half in (torch.float16, torch.bfloat16):
            value = value.to(half)
        q = nn.Parameter(value, requires_grad=False)
        memo[id(p)] = q
        if p.requires_grad:
            trained.append((p, q))
    for b in host.buffers():
        if id(b) not in memo:
            memo[id(b)] = _device_value(b, device)
    model = copy.deepcopy(host, memo)  # the modules, with the copies as tensors
    return model.eval(), trained


def _mergeable(host: nn.Module, copy: nn.Module) -> list[tuple[Any, Any]]:
    """(host, copy) LoRA layers whose adapter the copy can carry merged in its base weight:
    a base held as itself (not NF4-packed: its decoded copy would have to be decoded again
    at every refresh), no dropout in the way."""
    from engine.adapters.lora import lora_modules
    from engine.memory import packed_form

    mine = dict(lora_modules(copy))
    out = []
    for name, module in lora_modules(host):
        weight = module.base_layer.weight
        if packed_form(weight) is None and not isinstance(module.lora_dropout, nn.Dropout):
            out.append((module, mine[name]))
    return out


def _cache_keyword(model: nn.Module) -> str:
    """The forward's name for the KV cache (transformers renamed `past_key_values`)."""
    names = inspect.signature(model.forward).parameters
    return "cache" if "cache" in names else "past_key_values"


@dataclass(slots=True)
class Decoding:
    """One batch of rollouts being decoded: the prompts, the rows still to decode (indices
    into them, in order), and for every prompt what it made, its stop id and why it ended
    (None: not yet)."""

    prompts: Sequence[Sequence[int]]
    rows: list[int]
    made: list[list[int]]
    stops: list[int | None]
    finish: list[str | None]

    def width(self, at_least: int | None = None) -> int:
        """The longest of the rows' prompts, or `at_least` where that is longer."""
        return max([len(self.prompts[i]) for i in self.rows] + [at_least or 0])

    def left_padded(self, pad_id: int, width: int | None = None) -> tuple[Tensor, Tensor]:
        """The rows' prompts left-padded to `self.width(width)` (every row's last token in
        the last column), and their attention mask, on the host."""
        width = self.width(width)
        ids = torch.full((len(self.rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(self.rows), width), dtype=torch.long)
        for r, i in enumerate(self.rows):
            prompt = torch.tensor(list(self.prompts[i]), dtype=torch.long)
            ids[r, width - len(prompt) :] = prompt
            mask[r, width - len(prompt) :] = 1
        return ids, mask

    def choose_next(
        self,
        rows: Sequence[int],
        logits: Tensor,
        draw: Draw | None,
        *,
        stop: set[int],
        max_new_tokens: int,
        max_positions: int,
    ) -> tuple[Tensor, list[int]]:
        """Choose the next token of prompts `rows` from their last logits (greedy on the
        device, or `draw` over their fp32 values) and take it (`advance`). Returns the
        chosen ids (on the logits' device) and the places of the rows that go on."""
        chosen = logits.argmax(dim=-1) if draw is None else draw(logits.float())
        keep = self.advance(
            rows,
            chosen.tolist(),
            stop=stop,
            max_new_tokens=max_new_tokens,
            max_positions=max_positions,
        )
        return chosen, keep

    def advance(
        self,
        rows: Sequence[int],
        tokens: Sequence[int],
        *,
        stop: set[int],
        max_new_tokens: int,
        max_positions: int,
    ) -> list[int]:
        """Take `tokens[r]` as the next token of prompt `rows[r]`: a stop id ends the row
        ("stop", the id not kept), the token limit or the model's positions after it
        ("length"). Returns the places r of the rows that go on."""
        keep: list[int] = []
        for r, (i, token) in enumerate(zip(rows, tokens, strict=True)):
            if token in stop:
                self.finish[i], self.stops[i] = "stop", token
                continue
            self.made[i].append(token)
            if (
                len(self.made[i]) >= max_new_tokens
                or len(self.prompts[i]) + len(self.made[i]) >= max_positions
            ):
                self.finish[i] = "length"
                continue
            keep.append(r)
        return keep


class RolloutSampler:
    """One full copy of a HF causal LM on `device`, kept at the host model's current
    weights (`refresh`), that completes batches of prompts with a KV cache (`complete`)."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        *,
        keep: bool = True,
        graphs: bool = False,
        merged: bool = False,
        prompt_width: int | None = None,
    ) -> None:
        self.host = model
        self.device = device
        # True: the copy's LoRA adapters merged into its base weights (W + s B A, as the
        # trainer's replicas merge them), the base uploaded again at each refresh to merge
        # the new adapters into; a base that is not NF4-packed only
        self.merged = merged
        self._merges: list[tuple[Any, Any]] = []  # (host, copy) LoraLinears
        self.keep = keep  # False: `release` after each step's rollouts (Placement per_step)
        # True: the decode step replayed as a CUDA graph (`graph_decode`; run eagerly off a
        # GPU); back to the eager loop for good if that raises
        self.graphs = graphs
        # The longest prompt the job has: graph decoding pads every batch to it, so a step's
        # batches share one decoder shape
        self.prompt_width = prompt_width
        self._decoder: Any = None  # graph_decode.GraphDecoder of this step's rollouts
        # Every decoder's counters summed (GraphDecoder.counters), kept past step_done
        self.graph_counters: dict[str, float] = {}
        self.model: nn.Module | None = None
        # (host parameter, copy's parameter) of every weight that training changes
        self._trained: list[tuple[nn.Parameter, nn.Parameter]] = []
        self._cache_kw = _cache_keyword(model)

    @property
    def model_bytes(self) -> int:
        return _param_bytes(self.host)

    def _upload(self) -> nn.Module:
        model, self._trained = _device_copy(self.host, self.device)
        self._merges = _mergeable(self.host, model) if self.merged else []
        with torch.no_grad():
            for _, mine in self._merges:
                mine.merge_adapter()  # as the trainer's replicas merge (rp_after_upload)
        return model

    def refresh(self) -> None:
        """Make the copy's weights the host model's (call with the update synchronized)."""
        if self.model is None:
            self.model = self._upload()
            return
        with torch.no_grad():
            for host, mine in self._trained:
                mine.copy_(host.detach(), non_blocking=True)
            for host_module, module in self._merges:  # the base again, the new adapters in
                module.base_layer.weight.copy_(host_module.base_layer.weight, non_blocking=True)
                module.merge_adapter()

    def release(self) -> None:
        """Drop the copy from the device (the next `refresh` uploads it again)."""
        self.model = None
        self._trained = []
        self._merges = []
        self._drop_decoder()
        if self.device.type == "cuda":
            gc.collect()  # a module cycle would keep the copy's tensors alive
            torch.cuda.empty_cache()

    def _drop_decoder(self) -> None:
        """Free the graph decoder (its cache and graph), its counters added up first."""
        if self._decoder is not None:
            for key, value in self._decoder.counters().items():
                self.graph_counters[key] = self.graph_counters.get(key, 0) + value
        self._decoder = None

    def step_done(self) -> None:
        """After a step's rollouts: drop the copy unless it stays resident. A resident copy
        stays, and the KV cache's freed blocks go back to the device: the caching allocator
        keeps a block for the stream that freed it, and training allocates on the engine's
        own streams, so otherwise the rollouts' cache stays reserved beside training's
        memory (session 25, Qwen3-8B: 38.7 GiB allocated at most, 67.0 GiB reserved).
        The graph decoder (its static KV cache and its graph's pool) goes too."""
        self._drop_decoder()
        if not self.keep:
            self.release()
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _logits(self, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any) -> Tensor:
        assert self.model is not None
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        return out.logits[:, -1]

    def complete(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        stop: set[int],
        max_positions: int,
        pad_id: int,
        draw: Draw | None,
    ) -> list[Sample]:
        """Continuations of `prompts`, each token chosen by `draw` (None: greedy); the
        arguments as `sampling._complete`'s."""
        from transformers import DynamicCache

        if self.model is None:
            self.refresh()
        finish: list[str | None] = [
            "length" if not p or len(p) >= max_positions or max_new_tokens < 1 else None
            for p in prompts
        ]
        batch = Decoding(
            prompts=prompts,
            rows=[i for i, f in enumerate(finish) if f is None],
            made=[[] for _ in prompts],
            stops=[None for _ in prompts],
            finish=finish,
        )
        limits: dict[str, Any] = {
            "draw": draw,
            "max_new_tokens": max_new_tokens,
            "stop": stop,
            "max_positions": max_positions,
            "pad_id": pad_id,
        }
        if batch.rows and not self._generate(batch, **limits):
            with torch.inference_mode():
                self._decode(batch, DynamicCache, **limits)
        return [
            Sample(ids=m, finish_reason=f or "length", stop_id=e)
            for m, f, e in zip(batch.made, batch.finish, batch.stops, strict=True)
        ]

    def _generate(
        self,
        batch: Decoding,
        *,
        draw: Draw | None,
        max_new_tokens: int,
        stop: set[int],
        max_positions: int,
        pad_id: int,
    ) -> bool:
        """Decode `batch` through a `graph_decode.GraphDecoder` where this sampler replays
        and no row can reach the model's positions before its token limit; False where it
        did not (the rows as they were: the eager loop runs)."""
        from .graph_decode import GraphDecoder

        width = batch.width(self.prompt_width)
        if not self.graphs or width + max_new_tokens > max_positions:
            return False
        assert self.model is not None
        rows = len(batch.rows)
        try:
            with torch.inference_mode():
                if self._decoder is None or not self._decoder.fits(rows, width, max_new_tokens):
                    self._drop_decoder()  # the old cache goes before the new one is made
                    self._decoder = GraphDecoder(
                        self.model,
                        rows=rows,
                        width=width,
                        new_tokens=max_new_tokens,
                        capture=self.device.type == "cuda",
                    )
                self._decoder.decode(
                    batch,
                    draw=draw,
                    max_new_tokens=max_new_tokens,
                    stop=stop,
                    max_positions=max_positions,
                    pad_id=pad_id,
                )
            return True
        except Exception:
            # The eager loop starts again from the prompts; the draw's generator has moved
            # on, so these rollouts differ from the ones the replayed step would have made.
            log.warning("graph rollouts failed: decoding eagerly from now on", exc_info=True)
            self.graphs = False
            self._drop_decoder()
            for i in batch.rows:
                batch.made[i], batch.stops[i], batch.finish[i] = [], None, None
            return False

    def _decode(
        self,
        batch: Decoding,
        cache_cls: Any,
        *,
        draw: Draw | None,
        max_new_tokens: int,
        stop: set[int],
        max_positions: int,
        pad_id: int,
    ) -> None:
        dev = self.device
        rows = batch.rows
        ids, mask = batch.left_padded(pad_id)
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = cache_cls(config=self.model.config)  # type: ignore[union-attr]
        logits = self._logits(ids, mask, positions, cache)
        next_pos = positions[:, -1:] + 1
        limits = {"stop": stop, "max_new_tokens": max_new_tokens, "max_positions": max_positions}
        while True:
            _, keep = batch.choose_next(rows, logits, draw, **limits)
            if not keep:
                return
            tokens = torch.tensor(
                [[batch.made[rows[r]][-1]] for r in keep], dtype=torch.long, device=dev
            )
            if len(keep) < len(rows):  # finished rows leave the batch and the cache
                index = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.batch_select_indices(index)
                mask, next_pos = mask[index], next_pos[index]
                rows = [rows[r] for r in keep]
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
            logits = self._logits(tokens, mask, next_pos, cache)
            next_pos = next_pos + 1


def make_sampler(
    model: nn.Module,
    *,
    rows: int,
    tokens: int,
    streamed_only: bool = False,
    prompt_width: int | None = None,
) -> RolloutSampler | None:
    """A sampler on the first engine device for batches of `rows` sequences of at most
    `tokens` tokens, placed by `placement`: a full copy (`RolloutSampler`), else the layers
    streamed (`StreamedRolloutSampler`), else None (the engine's path). `streamed_only`:
    streamed even where the copy fits (`grpo.generation: streamed`); `prompt_width`: the
    longest prompt to come (graph decoding pads every batch to it)."""
    from engine.device import device_memory_bytes, get_devices

    from .streamed_generation import (
        StreamedRolloutSampler,
        packed_device_bytes,
        streamed_device_bytes,
    )

    device = get_devices()[0].device
    dtype = model.get_input_embeddings().weight.dtype
    model_bytes = _param_bytes(model)
    streamed = streamed_device_bytes(model)
    packed = packed_device_bytes(model)
    kv = kv_cache_bytes(model.config, rows=rows, tokens=tokens, dtype=dtype)
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    usable = device_memory_bytes(device)
    where = placement(
        model_bytes=model_bytes,
        kv_bytes=kv,
        usable=usable,
        held=held,
        streamed_bytes=streamed,
        packed_bytes=packed,
        streamed_only=streamed_only,
    )
    log.info(
        "rollout sampler on %s: %s%s (model %.2f GiB, streamed %s GiB, packed %s GiB, "
        "KV cache %.2f GiB, %.2f GiB free of %.2f GiB): %s",
        device,
        where,
        " (asked for streamed)" if streamed_only else "",
        model_bytes / (1 << 30),
        "-" if streamed is None else f"{streamed / (1 << 30):.2f}",
        "-" if packed is None else f"{packed / (1 << 30):.2f}",
        kv / (1 << 30),
        (usable - held) / (1 << 30),
        usable / (1 << 30),
        _WHY[where],
    )
    if where == "none":
        return None
    if where in ("streamed", "packed"):
        # The resident modules (and the packed layers) are dropped after each step's
        # rollouts too: the trainer has the device to itself, and their upload is a small
        # share of a step's decoding.
        return StreamedRolloutSampler(model, device, keep=False, packed_resident=where == "packed")
    from .graph_decode import graph_decoding_wanted

    graphs = graph_decoding_wanted(model, device)
    if graphs:
        how = "replayed as a CUDA graph" if device.type == "cuda" else "run uncaptured (no GPU)"
        log.info("rollout sampler: a static-cache decode step, %s", how)
    # Opt-in until measured on a GPU: it saves the adapters' kernels at every decode step
    # and costs an upload of the adapted base weights at every refresh.
    merged = os.environ.get("RP_MERGED_ROLLOUTS", "0") == "1"
    if merged:
        log.info("rollout sampler: the LoRA adapters merged into the copy's weights")
    return RolloutSampler(
        model,
        device,
        keep=where == "resident",
        graphs=graphs,
        merged=merged,
        prompt_width=prompt_width,
    )
