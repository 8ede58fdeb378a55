"""Rotary tables of the default positions, computed once per device, dtype and length.

Without `position_ids` every sequence of a micro-batch has positions 0..seq-1, so the
rotary cos/sin a decoder layer needs depend only on the rotary module's frequencies, the
device, the dtype and the sequence length. Every layer of every micro-batch used to
rebuild them: about ten small eager kernels and their Python per layer call, a visible
share of the host's time to issue a step (py-spy, bench/RESULTS.md), and the host's issue time is what bounds one process driving several GPUs. The tables are
computed by the layer's own rotary module the first time and reused, so the values are
bit for bit the ones it computes.

Not cached: caller-given positions (packed sequences), rotary types whose frequencies
change with the sequences seen ("dynamic", "longrope"), and calls under inference mode
(inference tensors cannot be saved for a later backward).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["DefaultRotaryCache", "default_rotary", "rotary_fingerprint"]

# Distinct (rotary, device, dtype, length) entries kept: a run has one per device and
# sequence length; padding to varying lengths cycles through a few.
ROTARY_CACHE_ENTRIES = 8

RotaryEntry = tuple[Tensor, tuple[Tensor, ...]]


def rotary_fingerprint(rotary_emb: nn.Module) -> tuple[Any, ...] | None:
    """What the default-position tables depend on besides device, dtype and length; None
    where they must be recomputed each call."""
    rope_type = getattr(rotary_emb, "rope_type", "default")
    if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope":
        return None
    inv_freq = getattr(rotary_emb, "inv_freq", None)
    if not isinstance(inv_freq, Tensor) or inv_freq.is_meta:
        return None
    return (
        type(rotary_emb).__qualname__,
        rope_type,
        tuple(inv_freq.detach().double().cpu().tolist()),
        float(getattr(rotary_emb, "attention_scaling", 1.0)),
    )


def _default_tables(rotary_emb: nn.Module, hidden: Tensor) -> RotaryEntry:
    """Positions 0..seq-1 as (1, seq) and the rotary module's (cos, sin) for them."""
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    return positions, tuple(rotary_emb(hidden, positions))


class DefaultRotaryCache:
    """A small least-recently-used map from (fingerprint, device, dtype, length) to the
    positions and the rotary module's output for them; safe to share between threads."""

    def __init__(self, entries: int = ROTARY_CACHE_ENTRIES) -> None:
        self.entries = entries
        self._tables: OrderedDict[tuple[Any, ...], RotaryEntry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tables)

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()

    def get(
        self, fingerprint: tuple[Any, ...], rotary_emb: nn.Module, hidden: Tensor
    ) -> RotaryEntry:
        key = (fingerprint, hidden.device, hidden.dtype, hidden.shape[1])
        with self._lock:
            hit = self._tables.get(key)
            if hit is not None:
                self._tables.move_to_end(key)
                return hit
        # Two threads may both miss and compute: the same values, one of them is kept.
        entry = _default_tables(rotary_emb, hidden)
        with self._lock:
            self._tables[key] = entry
            while len(self._tables) > self.entries:
                self._tables.popitem(last=False)
        return entry


_CACHE = DefaultRotaryCache()


def default_rotary(
    fingerprint: tuple[Any, ...] | None, rotary_emb: nn.Module, hidden: Tensor
) -> RotaryEntry:
    """Positions 0..seq-1 as (1, seq) and the rotary module's (cos, sin) for them."""
    if fingerprint is None or torch.is_inference_mode_enabled():
        return _default_tables(rotary_emb, hidden)
    return _CACHE.get(fingerprint, rotary_emb, hidden)
