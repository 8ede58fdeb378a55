"""Trainable pieces over a frozen base: LoRA adapters (lora).

The engine's front door re-exports `LoraConfig` and `apply_lora` (`from engine import ...`).
"""
