"""Wrap a model for RoundPipe: a Sequential preset when one exists, else an auto-split.

`wrap_model_to_roundpipe` tries the preset of the model's `config.model_type` (see
`engine.models.SUPPORTED_MODELS`); without one it walks the module tree
(`wrap_model_recursive`) and wraps every submodule whose size is between the thresholds
in its own `RoundPipe`, splitting larger ones into their children and leaving smaller
ones (and `skip_modules`) where they are: they then run on the host, around the RoundPipe
submodules, whose outputs come back to the host. When the root itself is not wrapped
whole, the result is an `AutoRoundPipe` over the modified model, which manages the
optimizer parameters and the async step but cannot pipeline `forward_backward`.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Mapping
from typing import Any

from torch import nn

from . import models
from .adapters.lora import apply_lora
from .call_site import get_call_location
from .device import get_num_devices
from .memory import get_model_size
from .roundpipe import AutoRoundPipe, RoundPipe
from .run_config import RoundPipeRunConfig

__all__ = ["get_call_location", "wrap_model_recursive", "wrap_model_to_roundpipe"]

log = logging.getLogger(__name__)

# Modules that only hold children and have no forward of their own: never wrapped whole.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _roundpipe_classes() -> tuple[type[nn.Module], type[nn.Module]]:
    # A function: tests of the split logic replace it with light stand-ins.
    return RoundPipe, AutoRoundPipe


def _contains(container: Container[nn.Module], module: nn.Module) -> bool:
    # Identity, not ==: a list's `in` compares with ==, which some modules override.
    if isinstance(container, (list, tuple)):
        return any(m is module for m in container)
    return module in container


def wrap_model_recursive(
    model: nn.Module,
    lower_threshold: int,
    upper_threshold: int,
    skip_modules: Container[nn.Module],
    override_config: Mapping[nn.Module, RoundPipeRunConfig],
    model_run_config: RoundPipeRunConfig,
    name: str,
    **roundpipe_kwargs: Any,
) -> nn.Module:
    """Wrap `model`, or parts of it, in RoundPipe by size; return what replaces `model`.

    - in `skip_modules`, or smaller than `lower_threshold` bytes: returned untouched;
    - an `nn.Sequential`, or at most `upper_threshold` bytes (and not a container such as
      `nn.ModuleList`): returned as a RoundPipe over it (a Sequential's children become
      its layers; any other module is one layer);
    - larger: each child is wrapped recursively and replaced in place, and the modified
      `model` itself is returned.

    Args:
        override_config: Per-module model_run_config, for the RoundPipe of that module.
        name: Name of `model`; children are named `name.child`.
        **roundpipe_kwargs: Forwarded to every RoundPipe (optim_dtype, pin_model).
    """
    if _contains(skip_modules, model):
        return model
    size = get_model_size(model)
    if size < lower_threshold:
        return model
    is_container = isinstance(model, _CONTAINERS)
    if isinstance(model, nn.Sequential) or (size <= upper_threshold and not is_container):
        roundpipe_cls, _ = _roundpipe_classes()
        run_config = override_config.get(model, model_run_config)
        log.debug("auto-split: %s (%d bytes) -> RoundPipe", name, size)
        return roundpipe_cls(model, name=name, model_run_config=run_config, **roundpipe_kwargs)
    for child_name, child in list(model.named_children()):
        wrapped = wrap_model_recursive(
            child,
            lower_threshold,
            upper_threshold,
            skip_modules,
            override_config,
            model_run_config,
            f"{name}.{child_name}",
            **roundpipe_kwargs,
        )
        if wrapped is not child:
            setattr(model, child_name, wrapped)
    return model


def wrap_model_to_roundpipe(
    model: nn.Module,
    use_sequential_preset: bool | None = None,
    lower_threshold: int = 16 * 1024,
    upper_threshold: int | None = None,
    skip_modules: Container[nn.Module] = (),
    override_config: Mapping[nn.Module, RoundPipeRunConfig] | None = None,
    model_run_config: RoundPipeRunConfig = RoundPipeRunConfig(),  # frozen: safe to share
    name: str | None = None,
    lora_config: Any = None,
    recompute_attention: bool = False,
    **roundpipe_kwargs: Any,
) -> nn.Module:
    """Return `model` wrapped for RoundPipe: a preset RoundPipe, or the auto-split result.

    Args:
        model: The model to wrap; its modules are reused, not copied.
        use_sequential_preset: None: use the preset of `config.model_type` if there is
            one, else the auto-split. True: the preset or an error. False: the auto-split.
        lower_threshold: Modules smaller than this (bytes) stay on the host, unwrapped (an
            `nn.Sequential` model itself is always a RoundPipe).
        upper_threshold: Modules larger than this (bytes) are split into their children.
            Default: the model's size / (number of devices + 1).
        skip_modules: Modules left untouched by the auto-split.
        override_config: Per-module model_run_config for the auto-split's RoundPipes.
        model_run_config: The default model_run_config.
        name: Name in logs and traces; default the caller's 'file:line'.
        lora_config: When given (an `engine.adapters.lora.LoraConfig`, a `peft.LoraConfig` or a
            mapping), `engine.adapters.lora.apply_lora` adds adapters to `model` and freezes the
            rest before wrapping: only the adapters get optimizer-side copies.
        recompute_attention: A preset's decoder layers recompute attention in the backward
            instead of keeping its output in host memory (see
            `engine.models.to_sequential`); the auto-split has no such layers.
        **roundpipe_kwargs: Forwarded to RoundPipe / AutoRoundPipe (optim_dtype,
            pin_model).

    Returns:
        A RoundPipe (preset, or a model wrapped whole) or an AutoRoundPipe (auto-split).

    Raises:
        NotImplementedError: `use_sequential_preset=True` and no preset fits the model;
            the message lists the supported models.
        ConfigError: A bad `lora_config` (see `engine.adapters.lora.apply_lora`).
    """
    if name is None:
        name = get_call_location(1)
    if lora_config is not None:
        apply_lora(model, lora_config)
    # None falls back to the auto-split when no preset fits; True lets wrap_model raise.
    if use_sequential_preset or (use_sequential_preset is None and models.has_preset(model)):
        return models.wrap_model(
            model,
            name=name,
            model_run_config=model_run_config,
            recompute_attention=recompute_attention,
            **roundpipe_kwargs,
        )
    if upper_threshold is None:
        upper_threshold = get_model_size(model) // (get_num_devices() + 1)
    if isinstance(model, nn.Sequential):
        # Already the form RoundPipe runs: one RoundPipe over its children, however small
        # (the thresholds decide how to split a model that is not a Sequential).
        lower_threshold = 0
    wrapped = wrap_model_recursive(
        model,
        lower_threshold,
        upper_threshold,
        skip_modules,
        override_config or {},
        model_run_config,
        name,
        **roundpipe_kwargs,
    )
    roundpipe_cls, auto_cls = _roundpipe_classes()
    if isinstance(wrapped, roundpipe_cls):
        return wrapped
    log.info("auto-split of %s: not one Sequential; wrapping in AutoRoundPipe", name)
    return auto_cls(wrapped, name=name, **roundpipe_kwargs)
