"""EngineOptions: what one training run asks of the engine, its choices and rules in one place.

The daemon maps a JobSpec to these once (`rp_service.spec_to_engine`) and plans host
memory from them at submission (`engine.planning.memory_plan.run_shape`); the worker wraps
the model and builds the optimizer from the same object. The choices (Literal aliases)
are declared here once: the daemon's pydantic schemas import them. Torch-free: the
daemon's request path imports this module.

Each rule between fields is checked once, in `EngineOptions.__post_init__`, and refused
with a `ConfigError` whose `field` is the dotted option to change; `names` renames the
options for a caller that knows them by other names (a JobSpec's `engine.num_microbatch`).
`to_json` / `from_json` carry the options between processes as JSON values (the daemon
stores what it mapped at submission and hands it to the worker in its spec.json).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from .errors import ConfigError

__all__ = [
    "FP8_MIN_CAPABILITY",
    "AdamOptions",
    "DtypeName",
    "EngineOptions",
    "Fp8Recipe",
    "LoraOptions",
    "MatmulPrecision",
    "OptimMemory",
    "OptimStateDtype",
    "OptionError",
    "PinModel",
    "Quantization",
    "RecomputeGrain",
    "default_num_microbatch",
    "fp8_capable",
]

DtypeName = Literal["float32", "float16", "bfloat16"]
RecomputeGrain = Literal["stage", "layer"]
OptimStateDtype = Literal["float32", "bfloat16"]
OptimMemory = Literal["default", "compact"]
PinModel = Literal["alloc", "register", "arena", "off"]
# "nf4": the frozen base's linear weights held 4-bit (engine.adapters.nf4), adapters only.
Quantization = Literal["none", "nf4"]
# "fp8": the decoder's linear layers multiply in float8 (engine.accel.fp8); "bf16": in the
# model's own dtype.
MatmulPrecision = Literal["bf16", "fp8"]
# How FP8 operands are scaled: a scale per row (every operand e4m3), per tensor (the
# output gradient e5m2), or per row with the weight gradient left in bf16 (its two casts
# along the tokens, the backward's costliest, skipped); torchao's recipes of those names.
Fp8Recipe = Literal["rowwise", "tensorwise", "rowwise_with_gw_hp"]
# CUDA compute capability from which GPUs multiply float8 in hardware (Ada, Hopper, newer).
FP8_MIN_CAPABILITY = (8, 9)


def fp8_capable(capability: str | tuple[int, int]) -> bool:
    """Whether a CUDA GPU of `capability` ('9.0' or (9, 0)) has FP8 matmuls."""
    if isinstance(capability, str):
        major, _, minor = capability.partition(".")
        try:
            capability = (int(major), int(minor or 0))
        except ValueError:
            return False
    return tuple(capability) >= FP8_MIN_CAPABILITY


class OptionError(ConfigError):
    """A rule of EngineOptions refused a value; `code` names the rule (stable, for APIs)."""

    def __init__(self, message: str, *, field: str, code: str) -> None:
        super().__init__(message, field=field)
        self.code = code


def default_num_microbatch(num_devices: int) -> int:
    """Micro-batches per call when a run config leaves `num_microbatch` unset: the
    devices + 1 (the seeds' default). RoundPipeRunConfig and the daemon's plan use it."""
    return num_devices + 1


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraOptions:
    """`engine.adapters.lora.LoraConfig`'s values for a run that trains adapters."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamOptions:
    """`engine.optim.Adam`'s hyperparameters (decoupled weight decay, as AdamW)."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineOptions:
    """What the engine is given for one training run, by the names of its options.

    Attributes:
        adam: The optimizer's hyperparameters (its peak lr; a schedule scales it).
        model_dtype: dtype of the model copy.
        batch_size: Rows (sequences, or preference pairs) a step splits into
            micro-batches; None: not known here (no check against num_microbatch).
        num_microbatch: RoundPipeRunConfig.num_microbatch; None: the engine's default
            (`num_microbatch_on`).
        recompute_grain: RoundPipeRunConfig.recompute_grain.
        optim_dtype: wrap_model_to_roundpipe's optim_dtype.
        optim_grad_dtype: wrap_model_to_roundpipe's optim_grad_dtype: None for a buffer
            in optim_dtype, else the model's dtype (the downloaded gradient read in place).
        pin_model: wrap_model_to_roundpipe's pin_model.
        recompute_attention: wrap_model_to_roundpipe's recompute_attention.
        optim_state_dtype: engine.optim.Adam's state_dtype.
        optim_memory: wrap_model_to_roundpipe's optim_memory: 'default', or 'compact' (the
            bf16 weights are the masters, the gradient read in place, Adam's moments in
            8 bits: docs/HOST_MEMORY_MODES.md), which supersedes optim_dtype,
            optim_grad_dtype and optim_state_dtype.
        async_step: RoundPipe.step's is_async.
        lora: The adapters, or None for a full fine-tune.
        quantization: The frozen base's weights: 'none', or 'nf4' (needs `lora`).
        max_gpu_memory_gib: RoundPipe's max_gpu_memory (GiB); None: the engine's default.
        layers_per_group: RoundPipe's layers_per_group (an explicit plan of equal layer
            groups); None: the automatic plan.
        matmul_precision: RoundPipe's matmul_precision: 'bf16', or 'fp8' (the decoder's
            linear layers in float8; needs model_dtype bfloat16 and, to be fast, GPUs of
            compute capability >= 8.9, which the caller checks: it knows the devices).
        fp8_recipe: RoundPipe's fp8_recipe: 'rowwise', 'tensorwise' or
            'rowwise_with_gw_hp' (with 'fp8' only).
        overlap_calls: RoundPipe's overlap_calls (each call's backward finishes behind the
            next call's forward), with its double-buffered weights: a second half-precision
            copy of the trainable weights in host memory.
        names: How a caller calls each option in messages and in `ConfigError.field`
            (e.g. {'num_microbatch': 'engine.num_microbatch'}); unnamed options keep
            their own name. Not compared.
    """

    adam: AdamOptions
    model_dtype: DtypeName = "float32"
    batch_size: int | None = None
    num_microbatch: int | None = None
    recompute_grain: RecomputeGrain = "stage"
    optim_dtype: DtypeName = "float32"
    optim_grad_dtype: DtypeName | None = None
    pin_model: PinModel = "alloc"
    recompute_attention: bool = False
    optim_state_dtype: OptimStateDtype = "float32"
    optim_memory: OptimMemory = "default"
    async_step: bool = True
    lora: LoraOptions | None = None
    quantization: Quantization = "none"
    max_gpu_memory_gib: float | None = None
    layers_per_group: int | None = None
    matmul_precision: MatmulPrecision = "bf16"
    fp8_recipe: Fp8Recipe = "rowwise"
    overlap_calls: bool = False
    names: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name, alias in _CHOICES.items():
            value = getattr(self, name)
            if value is not None and value not in get_args(alias):
                choices = " or ".join(repr(c) for c in get_args(alias))
                raise OptionError(
                    f"{self._name(name)} must be {choices}, got {value!r}",
                    field=self._name(name),
                    code="invalid_option",
                )
        for name in ("batch_size", "num_microbatch", "layers_per_group"):
            _positive(self, name, getattr(self, name), integer=True)
        _positive(self, "max_gpu_memory_gib", self.max_gpu_memory_gib)
        _positive(self, "adam.lr", self.adam.lr)
        rules = (
            self._micro_batches_fit,
            self._nf4_has_adapters,
            self._compact_is_bf16,
            self._fp8_is_bf16,
        )
        for rule in rules:
            refusal = rule()
            if refusal is not None:
                option, code, message = refusal
                raise OptionError(message, field=self._name(option), code=code)

    def _name(self, option: str) -> str:
        return self.names.get(option, option)

    # Each rule between fields: None, or (the option to change, the rule's code, message).

    def _micro_batches_fit(self) -> tuple[str, str, str] | None:
        # A micro-batch holds at least one row.
        n, rows = self.num_microbatch, self.batch_size
        if n is None or rows is None or n <= rows:
            return None
        nm, bs = self._name("num_microbatch"), self._name("batch_size")
        return (
            "num_microbatch",
            "num_microbatch_above_batch_size",
            f"{nm}: {n} micro-batches cannot be cut from {bs} {rows}; set {nm} to at most "
            f"{rows} (or leave it unset for the default), or raise {bs} to at least {n}",
        )

    def _nf4_has_adapters(self) -> tuple[str, str, str] | None:
        if self.quantization != "nf4" or self.lora is not None:
            return None
        q = self._name("quantization")
        return (
            "quantization",
            "nf4_needs_lora",
            f"{q}: nf4 freezes the base in 4 bits, which only adapters can train on; "
            f"{self.names.get('lora', 'give lora options')} or set {q} to 'none'",
        )

    def _compact_is_bf16(self) -> tuple[str, str, str] | None:
        if self.optim_memory != "compact" or self.model_dtype == "bfloat16":
            return None
        return (
            "optim_memory",
            "compact_needs_bfloat16",
            f"{self._name('optim_memory')}: compact keeps the bfloat16 weights as the "
            f"optimizer's masters; set {self._name('model_dtype')} to bfloat16 "
            f"(got {self.model_dtype})",
        )

    def _fp8_is_bf16(self) -> tuple[str, str, str] | None:
        if self.matmul_precision != "fp8" or self.model_dtype == "bfloat16":
            return None
        return (
            "matmul_precision",
            "fp8_needs_bfloat16",
            f"{self._name('matmul_precision')}: fp8 multiplies bfloat16 activations and "
            f"weights in float8; set {self._name('model_dtype')} to bfloat16 (got "
            f"{self.model_dtype}) or {self._name('matmul_precision')} to 'bf16'",
        )

    def to_json(self) -> dict[str, Any]:
        """The options as JSON values, `names` included; `from_json` builds them back."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["adam"] = {f.name: getattr(self.adam, f.name) for f in fields(AdamOptions)}
        if self.lora is not None:
            values["lora"] = {f.name: getattr(self.lora, f.name) for f in fields(LoraOptions)}
        values["names"] = dict(self.names)
        return values

    @classmethod
    def from_json(cls, values: Mapping[str, Any]) -> EngineOptions:
        """The options `to_json` gave (tuples back from JSON lists). Options a later
        release added take their defaults; the rules hold for anything `to_json` wrote, so
        building the object again decides nothing new.

        Raises:
            TypeError: A key these options do not have.
            OptionError: A value the rules refuse (not `to_json`'s output).
        """
        given = dict(values)
        adam = dict(given.pop("adam"))
        if "betas" in adam:
            adam["betas"] = tuple(adam["betas"])
        lora = given.pop("lora", None)
        if lora is not None:
            lora = LoraOptions(**{**lora, "target_modules": tuple(lora["target_modules"])})
        return cls(adam=AdamOptions(**adam), lora=lora, **given)

    def num_microbatch_on(self, num_devices: int) -> int:
        """The micro-batches per step on `num_devices` devices: num_microbatch, else the
        engine's default, at most batch_size (a micro-batch holds at least one row)."""
        if self.num_microbatch is not None:
            return self.num_microbatch
        default = default_num_microbatch(num_devices)
        return default if self.batch_size is None else min(default, self.batch_size)


_CHOICES: dict[str, Any] = {
    "model_dtype": DtypeName,
    "recompute_grain": RecomputeGrain,
    "optim_dtype": DtypeName,
    "optim_grad_dtype": DtypeName,
    "pin_model": PinModel,
    "optim_state_dtype": OptimStateDtype,
    "optim_memory": OptimMemory,
    "quantization": Quantization,
    "matmul_precision": MatmulPrecision,
    "fp8_recipe": Fp8Recipe,
}


def _positive(
    options: EngineOptions, option: str, value: float | None, *, integer: bool = False
) -> None:
    if value is None:
        return
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        name = options._name(option)
        what = "an int >= 1" if integer else "a number > 0"
        raise OptionError(
            f"{name} must be {what}, got {value!r}", field=name, code="invalid_option"
        )
