"""The exceptions the engine raises on purpose."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DeviceError",
    "DistributedError",
    "GradientsDisabledError",
    "HostMemoryError",
    "RoundPipeError",
    "SplitError",
    "StepError",
]


class RoundPipeError(Exception):
    """Base of every error the engine raises on purpose."""


class ConfigError(RoundPipeError, ValueError):
    """A config value or argument is out of range or inconsistent with another.

    `field` names the dotted config field to change (e.g. 'lora.rank'), where one is to
    blame; None otherwise.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class DeviceError(RoundPipeError):
    """A device failed, does not exist, or ran out of memory; `device` says which."""

    def __init__(self, message: str, *, device: str) -> None:
        super().__init__(message)
        self.device = device


class StepError(RoundPipeError, RuntimeError):
    """A `step_fn` raised on the optimizer thread; the original is the `__cause__`.

    Also a RuntimeError, so the usual `except RuntimeError` around a training step
    catches it as it catches an error of a synchronous optimizer step.
    """


class GradientsDisabledError(RoundPipeError, RuntimeError, AssertionError):
    """A call needs gradients but torch's grad mode is off (e.g. under torch.no_grad()).

    Also a RuntimeError and an AssertionError: the seeds document those two for
    forward(requires_grad=True) and forward_backward() respectively.
    """


class SplitError(ConfigError, AssertionError):
    """A custom split_input / split_label returned something malformed.

    Also an AssertionError, which the seeds document for malformed splitter output.
    """


class DistributedError(RoundPipeError):
    """A collective across data-parallel ranks failed: a rank died, or did not reach the
    same call within the process group's timeout."""


class HostMemoryError(ConfigError):
    """A run would need more host memory than the budget; the message names the need,
    the budget and the options that would fit.

    Attributes:
        need_bytes, budget_bytes: The plan's total and the budget.
        options: Each change that would fit, with what it would need.
        option_fields: The config field each option changes ('optim_state_dtype',
            'recompute_attention', 'lora', 'tokens_per_step').
        parts: The plan's bytes by part.
    """

    def __init__(
        self,
        message: str,
        *,
        need_bytes: int,
        budget_bytes: int,
        options: list[str],
        option_fields: list[str] | None = None,
        parts: dict[str, int] | None = None,
    ) -> None:
        super().__init__(message)
        self.need_bytes = need_bytes
        self.budget_bytes = budget_bytes
        self.options = options
        self.option_fields = option_fields or []
        self.parts = parts or {}
