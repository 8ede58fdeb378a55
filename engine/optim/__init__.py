"""CPU optimizers for RoundPipe: `Adam`, the C Adam over fp32 master weights.

`Adam` behaves like `torch.optim.Adam` (and `torch.optim.AdamW` with
`decoupled_weight_decay=True`): same arguments, param groups, lr schedulers, and a
`state_dict` either one loads. The update runs in C (csrc/, AVX-512 / AVX2 / scalar,
multi-threaded, GIL released) and, for a parameter given a half-precision model copy with
`set_model_copy()`, writes `copy = master.to(copy.dtype)` in the same pass.

Host memory per parameter (issue 15): the gradient may be fp16 or bf16 (the half-precision
gradient the devices downloaded, read in place: no fp32 gradient buffer), and
`state_dtype=torch.bfloat16` keeps exp_avg and exp_avg_sq in bf16 (computed in fp32, stored
with reproducible stochastic rounding): 12 bytes per parameter with the fp16 model and the
fp32 master instead of 18 (or 20 with a separate fp32 gradient).

The compact mode (issue 35) goes further: `state_dtype=torch.uint8` keeps the moments in 8
bits with one fp32 absmax per 256 elements (block-wise dynamic quantization, `_q8`), and the
parameters may be bf16 themselves, the master with no other copy (updated in fp32, stored
with the same reproducible stochastic rounding): 2 + 2 (bf16 gradient) + 2 + 1/32 bytes per
parameter, about 6.03.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from ..context import StepProgress, step_progress
from ..errors import ConfigError
from . import _deferred, _native, _q8, _sumsq
from ._native import (
    NativeBuildError,
    available_isas,
    get_isa,
    get_num_threads,
    native_info,
    physical_cores,
    set_isa,
    set_num_threads,
)

__all__ = [
    "Adam",
    "NativeBuildError",
    "available_isas",
    "current_model_copy",
    "get_isa",
    "get_model_copy",
    "get_num_threads",
    "native_info",
    "physical_cores",
    "set_isa",
    "set_model_copy",
    "set_num_threads",
    "stochastic_round_bf16",
]

log = logging.getLogger(__name__)

_COPY_ATTR = "_rp_model_copy"
# The master's version counter when Adam last wrote its model copy (current_model_copy).
_WRITTEN_ATTR = "_rp_model_copy_written"
_COPY_DTYPES = {torch.float16: 1, torch.bfloat16: 2}  # RP_COPY_FP16 / RP_COPY_BF16
_GRAD_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # RP_DTYPE_*
_STATE_DTYPES = {torch.float32: 0, torch.bfloat16: 2, torch.uint8: 3}  # uint8: RP_DTYPE_Q8
_PARAM_DTYPES = {torch.float32: 0, torch.bfloat16: 2}
_Q8_KEYS = ("exp_avg_absmax", "exp_avg_sq_absmax")
_MASK32 = 0xFFFFFFFF


def set_model_copy(param: Tensor, copy: Tensor | None) -> None:
    """Make `Adam.step()` write `copy = param.to(copy.dtype)` in the same pass as the update.

    Args:
        param: An fp32 master parameter that an `Adam` updates.
        copy: A contiguous fp16 or bf16 CPU tensor with param's numel (the half-precision
            model weights, e.g. in pinned memory), or None to stop writing one.
    """
    if hasattr(param, _WRITTEN_ATTR):
        delattr(param, _WRITTEN_ATTR)  # a new (or no) buffer holds nothing written yet
    if copy is None:
        if hasattr(param, _COPY_ATTR):
            delattr(param, _COPY_ATTR)
        return
    if copy.dtype not in _COPY_DTYPES:
        raise ConfigError(f"model copy must be torch.float16 or torch.bfloat16, got {copy.dtype}")
    if copy.device.type != "cpu" or not copy.is_contiguous():
        raise ConfigError(
            f"model copy must be a contiguous CPU tensor, got device {copy.device}, "
            f"contiguous={copy.is_contiguous()}"
        )
    if copy.numel() != param.numel():
        raise ConfigError(
            f"model copy has {copy.numel()} elements, its master parameter {param.numel()}"
        )
    setattr(param, _COPY_ATTR, copy)


def get_model_copy(param: Tensor) -> Tensor | None:
    """The half-precision copy set with `set_model_copy()`, or None."""
    return getattr(param, _COPY_ATTR, None)


def current_model_copy(param: Tensor) -> Tensor | None:
    """The model copy if it holds `param`'s present value, else None.

    It does once `Adam.step()` has written it, until `param` changes in any other way: an
    in-place torch op (a checkpoint load, a weight fix-up in the step function) bumps the
    master's version counter, which the C kernel's writes do not. RoundPipe's double-buffered
    weights publish such a copy by swapping it in instead of converting the master again.
    """
    copy = getattr(param, _COPY_ATTR, None)
    if copy is None or getattr(param, _WRITTEN_ATTR, None) != param._version:
        return None
    return copy


def _check_hyper(group: dict[str, Any], where: str) -> None:
    """Raise ConfigError naming the argument when a hyper-parameter is out of range."""
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ConfigError(f"{where}lr as a Tensor must have one element, got {lr.numel()}")
    if not float(lr) >= 0.0:
        raise ConfigError(f"{where}lr must be >= 0, got {float(lr)}")
    if not float(group["eps"]) >= 0.0:
        raise ConfigError(f"{where}eps must be >= 0, got {group['eps']}")
    if not float(group["weight_decay"]) >= 0.0:
        raise ConfigError(f"{where}weight_decay must be >= 0, got {group['weight_decay']}")
    betas = group["betas"]
    if len(betas) != 2:
        raise ConfigError(f"{where}betas must be a pair (beta1, beta2), got {betas!r}")
    for index, beta in enumerate(betas):
        if not 0.0 <= float(beta) < 1.0:
            raise ConfigError(f"{where}betas[{index}] must be in [0, 1), got {float(beta)}")
    if group.get("differentiable"):
        raise ConfigError(f"{where}differentiable=True is not supported by the C Adam")
    if group.get("capturable"):
        raise ConfigError(
            f"{where}capturable=True is not supported by the C Adam (CPU tensors, no graphs)"
        )


class Adam(torch.optim.Optimizer):
    """Adam / AdamW on the CPU, in C; writes the fp16/bf16 model copy in the same pass.

    Same arguments and results as `torch.optim.Adam` (atol 1e-6 in fp32).
    `foreach` and `fused` are accepted for compatibility and ignored;
    `capturable` and `differentiable` must stay False.

    Gradients may be fp32, fp16 or bf16 (widened exactly in the kernel), so RoundPipe's
    `optim_grad_dtype` equal to the model dtype needs no fp32 gradient buffer.

    Args:
        state_dtype: dtype of exp_avg and exp_avg_sq: torch.float32 (default, exact torch
            results) or torch.bfloat16 (half the state memory: 4 bytes per parameter
            instead of 8; the update is computed in fp32 and the moments are stored with
            stochastic rounding, see `stochastic_round_bf16`) or torch.uint8 (8-bit codes
            with one fp32 absmax per 256 elements, 2.03 bytes per parameter: see
            engine.optim._q8; the state dict holds the codes and the absmax tensors).
            amsgrad needs float32.

    Parameters may be fp32 or bf16. A bf16 parameter is its own master: the update is
    computed in fp32 and stored with stochastic rounding (a hash of the element index and
    the step, like the bf16 moments), so small updates are kept on average; such a
    parameter takes no model copy.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        if state_dtype not in _STATE_DTYPES:
            raise ConfigError(
                "state_dtype must be torch.float32, torch.bfloat16 or torch.uint8 (8-bit), "
                f"got {state_dtype}"
            )
        if amsgrad and state_dtype != torch.float32:
            raise ConfigError("amsgrad=True needs state_dtype=torch.float32")
        self.state_dtype = state_dtype
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        _check_hyper(defaults, "")
        super().__init__(params, defaults)
        self._grad_scale = 1.0  # clip_grad_norm_'s coefficient, for the next step()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its parameters and hyper-parameters."""
        index = len(self.param_groups)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_hyper(group, f"param_groups[{index}].")
            for i, p in enumerate(group["params"]):
                _check_param(p, f"param_groups[{index}].params[{i}]")
        except ConfigError:
            self.param_groups.pop()
            raise

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore state (also from torch.optim.Adam), filling keys older versions lack."""
        self.__dict__.setdefault("state_dtype", torch.float32)
        self.__dict__.setdefault("_grad_scale", 1.0)
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group.setdefault("decoupled_weight_decay", False)
            if group["amsgrad"] and self.state_dtype != torch.float32:
                raise ConfigError("amsgrad=True needs state_dtype=torch.float32")
            for p in group["params"]:
                p_state = self.state.get(p)
                if p_state and not torch.is_tensor(p_state["step"]):
                    p_state["step"] = torch.tensor(float(p_state["step"]), dtype=torch.float32)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, but keep the saved dtypes of the state tensors (torch casts
        them to the parameter's dtype: 8-bit codes would become numbers, a bf16
        parameter's fp32 absmax would lose bits, and a resume would not be exact);
        `step()` brings them into this optimizer's format."""
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"], strict=True):
            for p, key in zip(group["params"], saved_group["params"], strict=True):
                if key not in saved:
                    continue
                for name, value in saved[key].items():
                    if name != "step" and torch.is_tensor(value):
                        self.state[p][name] = value.to(device=p.device, copy=True)

    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """The 2-norm of every gradient this optimizer would step with, as an fp32 scalar
        (`torch.nn.utils.get_total_norm`'s value, summed in double by the C library over
        all cores: one read of the gradients, in a fraction of torch's time on the CPU).
        A gradient's sum kept since it became final (RoundPipe folds each layer's while the
        backward runs) is used as it is: the same norm, to the last bit (`_sumsq`)."""
        native = get_isa() != _native.TORCH_FALLBACK
        grads = self._grads(native=native)
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        if not native:
            return torch.nn.utils.get_total_norm(grads).to(torch.float32)
        return torch.tensor(math.sqrt(_sumsq.total(grads)), dtype=torch.float32)

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, *, total_norm: float | Tensor | None = None
    ) -> Tensor:
        """`torch.nn.utils.clip_grad_norm_(params, max_norm)` over this optimizer's
        gradients, returning the total norm; the multiply by the clip coefficient
        (max_norm / (norm + 1e-6), at most 1, in fp32 as torch computes it) is done by the
        next `step()` as it reads each gradient, not by a pass of its own. So the gradients
        keep their values until then, and the update is bit for bit the one after torch's
        clip with the same norm. The norm itself is summed in double (`grad_norm`), so it
        may differ from torch's fp32 sum in the last bits. `zero_grad()` forgets a clip not
        yet applied. Without the C library the gradients are multiplied at once, as torch.
        `total_norm`: the norm to clip by instead of this optimizer's own (data parallel:
        `engine.parallel.data_parallel.grad_norm(rp)`, over every rank's shard)."""
        if total_norm is None:
            norm = self.grad_norm()
        else:
            norm = torch.as_tensor(total_norm, dtype=torch.float32)
        coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
        if get_isa() == _native.TORCH_FALLBACK:
            torch._foreach_mul_(self._grads(native=False), coef)
        else:
            self._grad_scale = float(coef)
        return norm

    def _grads(self, *, native: bool) -> list[Tensor]:
        """Every gradient this optimizer would step with (parameters without one left out);
        `native`: a deferred one as the tensor the C library reads (`_grad`)."""
        grads = (_grad(p, native) for group in self.param_groups for p in group["params"])
        return [g for g in grads if g is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad, also dropping a clip that no step applied (and a deferred
        gradient, uncopied: engine.optim._deferred)."""
        self._grad_scale = 1.0
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    _deferred.drop(p)
                else:  # torch zeroes the gradient tensor in place: give it the one it had
                    _deferred.settle(p)
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a gradient; returns the closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        isa = get_isa()
        entries = self._collect(native=isa != _native.TORCH_FALLBACK)
        grad_scale, self._grad_scale = self._grad_scale, 1.0
        if not entries:
            return loss
        steps = [state["step"] for _, _, state, _ in entries]
        torch._foreach_add_(steps, 1)  # one call for every param's step counter
        step_values = [float(s) for s in steps]
        progress = step_progress()  # RoundPipe's when it publishes layer by layer (compact)
        for batch, batch_steps in _batches(entries, step_values, progress):
            if isa == _native.TORCH_FALLBACK:
                for (p, grad, state, group), step in zip(batch, batch_steps, strict=True):
                    if p.dtype == torch.float32 and state["exp_avg"].dtype != torch.uint8:
                        _torch_update(p, grad, state, group, step)
                    else:  # the compact modes' fallback is their exact reference
                        h = _hyper_values(group, step)
                        _q8.exact_update(p, grad, state, h, stochastic_round_bf16)
            else:
                _native_update(batch, batch_steps, isa, grad_scale)
            for p, _, _, _ in batch:
                if hasattr(p, _COPY_ATTR):
                    setattr(p, _WRITTEN_ATTR, p._version)  # after the fallback's in-place ops
                if progress is not None:
                    progress.updated(p)
        return loss

    def _collect(
        self, *, native: bool
    ) -> list[tuple[Tensor, Tensor, dict[str, Any], dict[str, Any]]]:
        """(param, grad, state, group) for every param with a grad; state made ready.
        `native`: a deferred gradient as the tensor the C library reads (`_grad`)."""
        entries = []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                grad = _grad(p, native)
                if grad is None:
                    continue
                where = f"param_groups[{gi}].params[{i}]"
                if grad.is_sparse:
                    raise ConfigError(f"{where}: sparse gradients are not supported")
                if grad.dtype not in _GRAD_DTYPES or grad.device.type != "cpu":
                    raise ConfigError(
                        f"{where}: the gradient must be an fp32, fp16 or bf16 CPU tensor, got "
                        f"{grad.dtype} on {grad.device}"
                    )
                if grad.shape != p.shape:
                    raise ConfigError(f"{where}: grad shape {grad.shape} != param {p.shape}")
                _check_param(p, where)
                state = self.state[p]
                sdt = self.state_dtype
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    if sdt == torch.uint8:
                        state.update(_q8.zero_state(p))
                    else:
                        state["exp_avg"] = torch.zeros(p.shape, dtype=sdt)
                        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=sdt)
                _convert_moments(state, sdt)
                if group["amsgrad"] and "max_exp_avg_sq" not in state:
                    state["max_exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.contiguous_format
                    )
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", *_Q8_KEYS):
                    # A loaded state dict may hold another layout or dtype; the kernel needs
                    # dense tensors of state_dtype (max_exp_avg_sq, absmax: always fp32).
                    want = sdt if key in ("exp_avg", "exp_avg_sq") else torch.float32
                    value = state.get(key)
                    if value is not None and not (value.is_contiguous() and value.dtype == want):
                        state[key] = value.to(want).contiguous()
                entries.append((p, grad.contiguous(), state, group))
        return entries


def _grad(p: Tensor, native: bool) -> Tensor | None:
    """p's gradient; for the C library (`native`) a deferred one as the tensor it is a copy
    of (RoundPipe's half-precision download: the kernels widen it exactly as they read it),
    else as `p.grad` makes it, in p's dtype."""
    source = _deferred.deferred(p) if native else None
    return source if source is not None else p.grad


def _batches(
    entries: list[tuple[Tensor, Tensor, dict[str, Any], dict[str, Any]]],
    step_values: list[float],
    progress: StepProgress | None,
) -> Iterator[tuple[list[Any], list[float]]]:
    """The update's kernel calls: one for all the entries, or, reporting to `progress`, one
    per rank it gives (a RoundPipe layer), lowest rank first. Each element is updated on its own,
    so neither the order nor the split changes a bit of the result."""
    if progress is None:
        yield entries, step_values
        return
    ranks = [progress.order(p) for p, _, _, _ in entries]
    in_order = sorted(range(len(entries)), key=ranks.__getitem__)  # stable: group order within
    for _, run in itertools.groupby(in_order, key=ranks.__getitem__):
        ks = list(run)
        yield [entries[k] for k in ks], [step_values[k] for k in ks]


def _convert_moments(state: dict[str, Any], sdt: torch.dtype) -> None:
    """Bring loaded moments into `sdt`'s format: a state dict of another mode (8-bit into
    fp32/bf16 or back) is dequantized or quantized once."""
    have_q8 = state["exp_avg"].dtype == torch.uint8
    if have_q8 == (sdt == torch.uint8):
        return
    if have_q8:
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            values = _q8.dequantize(state[key], state.pop(f"{key}_absmax"), signed=signed)
            state[key] = values.reshape(state[key].shape).to(sdt)
        return
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        state[key], state[f"{key}_absmax"] = _q8.quantize(state[key].float(), signed=signed)


def _check_param(p: Tensor, where: str) -> None:
    if p.dtype not in _PARAM_DTYPES:
        raise ConfigError(
            f"{where}: engine.optim.Adam updates fp32 or bf16 parameters, got {p.dtype}; give "
            "it the fp32 master weights (e.g. RoundPipe's optim_dtype=torch.float32), bf16 "
            "weights (RoundPipe's optim_memory='compact'), or use torch.optim.Adam"
        )
    if p.device.type != "cpu":
        raise ConfigError(f"{where}: engine.optim.Adam updates CPU tensors, got {p.device}")
    if not p.is_contiguous():
        raise ConfigError(f"{where}: the parameter must be contiguous")


def _hyper_values(group: dict[str, Any], step: float) -> dict[str, Any]:
    """The kernel's scalars, computed in double as torch's _single_tensor_adam does."""
    lr = float(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    weight_decay = float(group["weight_decay"])
    decoupled = bool(group["decoupled_weight_decay"])
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return {
        "l2_weight_decay": weight_decay,
        "decoupled_decay": 1 - lr * weight_decay,
        "beta1_weight": 1 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1 - beta2,
        # The kernel multiplies by this instead of dividing by the square root (adam.c).
        "inv_bias_correction2_sqrt": 1 / bias_correction2**0.5,
        "eps": float(group["eps"]),
        "neg_step_size": -(lr / bias_correction1),
        "grad_scale": 1.0,  # Adam.clip_grad_norm_'s coefficient (_native_update)
        "maximize": int(bool(group["maximize"])),
        "use_l2": int(weight_decay != 0 and not decoupled),
        "use_decoupled": int(weight_decay != 0 and decoupled),
        "amsgrad": int(bool(group["amsgrad"])),
        "sr_seed": _sr_seed(step),
        "param_sr_seed": _param_sr_seed(step),
        "qmap": _q8.QMAP.data_ptr(),
    }


def _sr_seed(step: float) -> int:
    """The 32-bit value the step mixes into the bf16 moments' rounding bits."""
    return (int(step) * 0x9E3779B9) & _MASK32


def _param_sr_seed(step: float) -> int:
    """The same for a bf16 parameter's rounding bits (another stream than the moments')."""
    return (int(step) * 0x85EBCA6B + 0x632BE5AB) & _MASK32


def _native_update(
    entries: list[tuple[Tensor, Tensor, dict[str, Any], dict[str, Any]]],
    step_values: list[float],
    isa: str,
    grad_scale: float = 1.0,
) -> None:
    native = _native.load()
    ffi, lib = native.ffi, native.lib
    hyper_index: dict[tuple[int, float], int] = {}
    hyper_rows: list[dict[str, Any]] = []
    tensors = ffi.new("rp_adam_tensor[]", len(entries))
    eight_bit = False
    for k, ((p, grad, state, group), step) in enumerate(zip(entries, step_values, strict=True)):
        key = (id(group), step)
        if key not in hyper_index:
            hyper_index[key] = len(hyper_rows)
            hyper_rows.append({**_hyper_values(group, step), "grad_scale": grad_scale})
        desc = tensors[k]
        desc.param = p.data_ptr()
        desc.grad = grad.data_ptr()
        desc.exp_avg = state["exp_avg"].data_ptr()
        desc.exp_avg_sq = state["exp_avg_sq"].data_ptr()
        desc.max_exp_avg_sq = state["max_exp_avg_sq"].data_ptr() if group["amsgrad"] else 0
        if state["exp_avg"].dtype == torch.uint8:
            eight_bit = True
            desc.exp_avg_absmax = state["exp_avg_absmax"].data_ptr()
            desc.exp_avg_sq_absmax = state["exp_avg_sq_absmax"].data_ptr()
        desc.param_dtype = _PARAM_DTYPES[p.dtype]
        copy = get_model_copy(p)
        if copy is not None:
            if p.dtype != torch.float32:
                raise ConfigError("a bf16 parameter is its own master: give it no model copy")
            if copy.numel() != p.numel():
                raise ConfigError(f"model copy of a {p.numel()}-element param has {copy.numel()}")
            desc.model_copy = copy.data_ptr()
            desc.copy_dtype = _COPY_DTYPES[copy.dtype]
        desc.numel = p.numel()
        desc.hyper = hyper_index[key]
        desc.grad_dtype = _GRAD_DTYPES[grad.dtype]
        desc.state_dtype = _STATE_DTYPES[state["exp_avg"].dtype]
    if isa == "avx512" and eight_bit:
        _native.q8_lookup(lib)  # times the two lookups once per process
    hypers = ffi.new("rp_adam_hyper[]", hyper_rows)
    # cffi releases the GIL for the call; `entries` keeps every tensor alive until it returns.
    rc = lib.rp_adam_step(tensors, len(entries), hypers, get_num_threads(), _native.ISAS[isa])
    if rc != 0:
        raise ConfigError(f"the C Adam refused isa {isa!r} (code {rc})")


def _torch_update(
    p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any], step: float
) -> None:
    """The opt-in fallback without C: torch ops in _single_tensor_adam's order.

    Also the reference of the low-precision modes: a half gradient is widened first, bf16
    moments are widened, updated in fp32 and stored with `stochastic_round_bf16`.
    """
    h = _hyper_values(group, step)
    grad = grad.float()
    if h["maximize"]:
        grad = -grad
    if h["use_decoupled"]:
        p.mul_(h["decoupled_decay"])
    elif h["use_l2"]:
        grad = grad.add(p, alpha=h["l2_weight_decay"])
    exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
    exp_avg.lerp_(grad, h["beta1_weight"])
    exp_avg_sq.mul_(h["beta2"]).addcmul_(grad, grad, value=h["one_minus_beta2"])
    second = exp_avg_sq
    if h["amsgrad"]:
        torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
        second = state["max_exp_avg_sq"]
    bias_correction2_sqrt = (1 - float(group["betas"][1]) ** step) ** 0.5
    denom = (second.sqrt() / bias_correction2_sqrt).add_(h["eps"])
    p.addcdiv_(exp_avg, denom, value=h["neg_step_size"])
    for key, value, which in (("exp_avg", exp_avg, 0), ("exp_avg_sq", exp_avg_sq, 1)):
        if state[key].dtype == torch.bfloat16:
            state[key].copy_(stochastic_round_bf16(value, which=which, seed=h["sr_seed"]))
        elif state[key] is not value:
            state[key].copy_(value)
    copy = get_model_copy(p)
    if copy is not None:
        copy.view(-1).copy_(p.view(-1))


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _hash32(x: Tensor) -> Tensor:
    """rp_hash32 (csrc/adam.c) on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stochastic_round_bf16(x: Tensor, *, which: int, seed: int) -> Tensor:
    """`x` (fp32) rounded to bf16 the way the C Adam stores its bf16 moments.

    Element i gets 16 random bits, `hash32((2 i + which) ^ seed) & 0xFFFF`, added below the
    bits bf16 keeps, then the rest is truncated: the result is x rounded up with probability
    equal to its distance from the lower neighbour, so E[result] = x and a moment whose
    per-step change is below half a bf16 ulp (v * 0.999) still moves on average. The bits
    depend only on the element index and the step: reproducible on every ISA and thread
    count. NaN becomes the canonical 0x7FC0.
    """
    flat = x.detach().reshape(-1).float().contiguous()
    index = torch.arange(flat.numel(), dtype=torch.int64) & _MASK32
    key = ((index * 2 + which) & _MASK32) ^ (seed & _MASK32)
    noise = _hash32(key) & 0xFFFF
    bits = flat.view(torch.int32).to(torch.int64) & _MASK32
    out = (((bits + noise) & _MASK32) >> 16).masked_fill(flat.isnan(), 0x7FC0)
    out = torch.where(out >= 0x8000, out - 0x10000, out).to(torch.int16)
    return out.view(torch.bfloat16).reshape(x.shape)
