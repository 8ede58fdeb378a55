"""Bad input gets a clear error that names the argument, and the model stays usable."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import ConfigError, DeviceError, RoundPipe, RoundPipeRunConfig, StepError
from engine.device import parse_rp_devices

from ._models import make_batch, make_model


def _loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out - label) ** 2).mean()


@pytest.mark.skipif(torch.cuda.is_available(), reason="register works with CUDA")
def test_pin_register_needs_cuda() -> None:
    with pytest.raises(ConfigError, match="pin_model='register'.*needs CUDA"):
        RoundPipe(make_model(), pin_model="register")


def test_pin_model_value_is_checked() -> None:
    model = make_model()
    with pytest.raises(
        ConfigError, match="pin_model must be 'alloc', 'register', 'arena' or 'off'"
    ):
        RoundPipe(model, pin_model="yes")  # type: ignore[arg-type]
    RoundPipe(model, pin_model="off")  # the same model wraps fine afterwards


def test_unknown_recompute_grain() -> None:
    with pytest.raises(ConfigError, match="recompute_grain must be 'stage' or 'layer'"):
        RoundPipeRunConfig(recompute_grain="block")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_microbatch must be an int >= 1"):
        RoundPipeRunConfig(num_microbatch=0)


def test_batch_too_small_then_usable(cpu3: int) -> None:
    model = make_model().eval()
    ref = copy.deepcopy(model)
    rp = RoundPipe(model)
    x, y = make_batch(batch=3)
    with pytest.raises(ConfigError, match="cannot split .* size 3 .* num_microbatch=4"):
        rp.forward_backward(
            (x,), label=y, loss_fn=_loss, run_config=RoundPipeRunConfig(num_microbatch=4)
        )
    loss = rp.forward_backward(
        (x,), label=y, loss_fn=_loss, run_config=RoundPipeRunConfig(num_microbatch=3)
    )
    assert torch.isfinite(loss)
    with torch.no_grad():
        torch.testing.assert_close(
            rp(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1)), ref(x)
        )


def test_label_batch_mismatch(cpu3: int) -> None:
    rp = RoundPipe(make_model())
    x, _ = make_batch(batch=8)
    _, y = make_batch(batch=6)
    with pytest.raises(
        ConfigError, match="label batch size 6 does not match the input batch size 8"
    ):
        rp.forward_backward(
            (x,), label=y, loss_fn=_loss, run_config=RoundPipeRunConfig(num_microbatch=2)
        )


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("cpu:0", "needs N >= 1"),
        ("tpu", "not understood"),
        ("cuda:7", "GPU|CUDA"),
    ],
)
def test_rp_devices_must_exist(value: str, match: str) -> None:
    with pytest.raises(DeviceError, match=match):
        parse_rp_devices(value)


def test_step_fn_error_surfaces_at_next_call(cpu3: int) -> None:
    model = make_model().eval()
    rp = RoundPipe(model)
    x, y = make_batch(batch=8)

    def broken() -> None:
        raise RuntimeError("optimizer exploded")

    rp.forward_backward((x,), label=y, loss_fn=_loss)
    rp.step(broken)  # async: returns before the failure
    with pytest.raises(StepError, match="optimizer exploded"):
        rp.forward_backward((x,), label=y, loss_fn=_loss)
    # usable again
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    rp.forward_backward((x,), label=y, loss_fn=_loss)
    rp.step(opt.step, is_async=False)
    rp.synchronize()


def test_loss_fn_error_leaves_model_usable(cpu3: int) -> None:
    rp = RoundPipe(make_model().eval())
    x, y = make_batch(batch=8)

    def bad_loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad loss")

    with pytest.raises(ValueError, match="bad loss"):
        rp.forward_backward((x,), label=y, loss_fn=bad_loss)
    assert torch.isfinite(rp.forward_backward((x,), label=y, loss_fn=_loss))


def test_calls_that_need_gradients_under_no_grad(cpu3: int) -> None:
    rp = RoundPipe(make_model())
    x, y = make_batch(batch=8)
    # The seeds document AssertionError for forward_backward and RuntimeError for forward.
    with torch.no_grad(), pytest.raises(AssertionError, match="no_grad"):
        rp.forward_backward((x,), label=y, loss_fn=_loss)
    with torch.no_grad(), pytest.raises(RuntimeError, match="gradients are disabled"):
        rp(x, roundpipe_run_config=RoundPipeRunConfig(requires_grad=True))


def test_malformed_custom_splitter(cpu3: int) -> None:
    from engine.errors import SplitError

    rp = RoundPipe(make_model().eval())
    x, _ = make_batch(batch=8)
    bad = RoundPipeRunConfig(num_microbatch=2, split_input=lambda a, k, n: [((x,), {})])
    with torch.no_grad(), pytest.raises(SplitError, match="num_microbatch=2"):
        rp(x, roundpipe_run_config=bad)
    with torch.no_grad(), pytest.raises(AssertionError):  # the seeds' documented type
        rp(x, roundpipe_run_config=bad)


def test_run_config_takes_the_seeds_order_of_arguments() -> None:
    """RoundPipeRunConfig(requires_grad, output_device, preserve_rng_state, recompute_grain,
    num_microbatch, split_input, split_label, merge_output, execute_plan), as the seeds
    give its __init__; it stays frozen (a per-call config is merged, never changed)."""
    import dataclasses
    import inspect

    from engine import RoundPipeRunConfig

    names = list(inspect.signature(RoundPipeRunConfig).parameters)
    assert names[:9] == [
        "requires_grad",
        "output_device",
        "preserve_rng_state",
        "recompute_grain",
        "num_microbatch",
        "split_input",
        "split_label",
        "merge_output",
        "execute_plan",
    ]
    cfg = RoundPipeRunConfig(None, "cpu", False, "layer", 4)
    assert (cfg.output_device, cfg.preserve_rng_state, cfg.recompute_grain) == (
        "cpu",
        False,
        "layer",
    )
    assert cfg.num_microbatch == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_microbatch = 8  # type: ignore[misc]
