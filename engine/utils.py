"""The seeds' `utils` module by its name: each helper lives with its main caller
(`engine.call_site`, `engine.memory`); importing them from here is the same."""

from __future__ import annotations

from .call_site import get_call_location
from .memory import get_model_active_size, get_model_size

__all__ = ["get_call_location", "get_model_active_size", "get_model_size"]
