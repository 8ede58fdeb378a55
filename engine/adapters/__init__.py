"""Trainable pieces over a frozen base: LoRA adapters (lora) and their files in peft's
format (peft_format: state dict, adapter folders, merged exports).

The engine's front door re-exports `LoraConfig` and `apply_lora` (`from engine import ...`).
The wrappers import these modules, never the other way round: lora finds a RoundPipe
wrapper by its `rp_unwrap` hook.
"""
