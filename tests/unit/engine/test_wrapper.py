"""wrap_model_to_roundpipe: preset dispatch, the unsupported-model error, the auto-split.

The split decisions are tested with stand-in RoundPipe/AutoRoundPipe classes that record
what they were given; the engine's own classes are used where they exist (see the end).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from engine import models, wrapper
from engine.run_config import RoundPipeRunConfig
from tests.tiny_models import WIDE, tiny_model

transformers = pytest.importorskip("transformers")


class FakeRoundPipe(nn.Module):
    def __init__(self, model: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.model = model
        self.kwargs = kwargs
        self.original_model: nn.Module | None = None

    def set_original_model(self, original: nn.Module) -> None:
        self.original_model = original

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


class FakeAutoRoundPipe(FakeRoundPipe):
    pass


# `models.wrap_model` builds the RoundPipe it imported from engine.roundpipe; point it at
# the fake, and the auto-split at both fakes.
@pytest.fixture(autouse=True)
def _fake_roundpipe_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "RoundPipe", FakeRoundPipe)
    monkeypatch.setattr(wrapper, "_roundpipe_classes", lambda: (FakeRoundPipe, FakeAutoRoundPipe))


def tiny_qwen3() -> nn.Module:
    return tiny_model("qwen3", seed=None, max_position_embeddings=None, **WIDE)


class Net(nn.Module):
    """Not a Sequential: an embedding (big), a ModuleList of blocks, a tiny norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 64)  # 256,000 bytes
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)) for _ in range(3)]
        )  # 33,280 bytes each
        self.mlp = nn.Linear(64, 200)  # 51,200 bytes
        self.norm = nn.LayerNorm(64)  # 512 bytes
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.mlp(self.norm(h)) * self.scale


def test_preset_is_used_and_keeps_the_hf_model() -> None:
    hf = tiny_qwen3()
    cfg = RoundPipeRunConfig(num_microbatch=2)
    rp = wrapper.wrap_model_to_roundpipe(hf, model_run_config=cfg, optim_dtype=torch.float32)
    assert isinstance(rp, FakeRoundPipe) and not isinstance(rp, FakeAutoRoundPipe)
    assert isinstance(rp.model, nn.Sequential)
    assert len(rp.model) == hf.config.num_hidden_layers + 2
    assert rp.original_model is hf
    assert rp.kwargs["model_run_config"] is cfg
    assert rp.kwargs["optim_dtype"] is torch.float32
    assert rp.kwargs["name"].startswith("test_wrapper.py:")  # the caller's location


def test_unsupported_model_with_preset_true_raises_listing_presets() -> None:
    with pytest.raises(NotImplementedError) as err:
        wrapper.wrap_model_to_roundpipe(Net(), use_sequential_preset=True)
    message = str(err.value)
    assert "Qwen3ForCausalLM" in message and "LlamaForCausalLM" in message
    assert "use_sequential_preset" in message


def test_wrong_class_of_supported_type_falls_back_unless_forced() -> None:
    base = tiny_qwen3().model  # Qwen3Model: model_type qwen3, but no LM head
    with pytest.raises(NotImplementedError, match="Qwen3ForCausalLM"):
        wrapper.wrap_model_to_roundpipe(base, use_sequential_preset=True)
    auto = wrapper.wrap_model_to_roundpipe(base, upper_threshold=200_000)
    assert isinstance(auto, FakeAutoRoundPipe)


def test_preset_false_skips_the_preset() -> None:
    hf = tiny_qwen3()
    out = wrapper.wrap_model_to_roundpipe(hf, use_sequential_preset=False, upper_threshold=200_000)
    assert isinstance(out, FakeAutoRoundPipe)
    assert out.model is hf  # modified in place: the decoder layers became RoundPipes
    assert all(isinstance(layer, FakeRoundPipe) for layer in hf.model.layers)


def test_auto_split_by_thresholds() -> None:
    net = Net()
    blocks = list(net.blocks)
    override = RoundPipeRunConfig(num_microbatch=3)
    out = wrapper.wrap_model_to_roundpipe(
        net,
        lower_threshold=1024,
        upper_threshold=100_000,
        skip_modules=[net.mlp],
        override_config={blocks[1]: override},
        name="net",
        pin_model="off",
    )
    assert isinstance(out, FakeAutoRoundPipe) and out.model is net
    # 256 kB > upper: split; an Embedding has no children, so it stays (runs on the host).
    assert isinstance(net.embed, nn.Embedding)
    # The ModuleList is a container: never wrapped whole; each Sequential block is.
    assert isinstance(net.blocks, nn.ModuleList)
    assert [b.model for b in net.blocks] == blocks
    assert [b.kwargs["name"] for b in net.blocks] == [
        "net.blocks.0",
        "net.blocks.1",
        "net.blocks.2",
    ]
    assert net.blocks[1].kwargs["model_run_config"] is override
    assert net.blocks[0].kwargs["model_run_config"] == RoundPipeRunConfig()
    assert all(b.kwargs["pin_model"] == "off" for b in net.blocks)
    assert isinstance(net.mlp, nn.Linear)  # skipped
    assert isinstance(net.norm, nn.LayerNorm)  # below lower_threshold
    assert out.kwargs == {"name": "net", "pin_model": "off"}


def test_sequential_root_becomes_one_roundpipe() -> None:
    seq = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    out = wrapper.wrap_model_to_roundpipe(seq, lower_threshold=0)
    assert isinstance(out, FakeRoundPipe) and not isinstance(out, FakeAutoRoundPipe)
    assert out.model is seq
    # below the default lower threshold (16 KiB) too: it is already in Sequential form
    tiny = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    out = wrapper.wrap_model_to_roundpipe(tiny, use_sequential_preset=False)
    assert isinstance(out, FakeRoundPipe) and not isinstance(out, FakeAutoRoundPipe)
    assert out.model is tiny
    # skipped, it stays as it is, under an AutoRoundPipe
    out = wrapper.wrap_model_to_roundpipe(tiny, skip_modules=[tiny])
    assert isinstance(out, FakeAutoRoundPipe)


def test_auto_split_output_matches_the_model() -> None:
    net = Net()
    x = torch.randint(0, 1000, (2, 5))
    expected = net(x)
    out = wrapper.wrap_model_to_roundpipe(net, lower_threshold=1024, upper_threshold=40_000)
    torch.testing.assert_close(out(x), expected)


def test_get_call_location_names_the_caller() -> None:
    here = wrapper.get_call_location(0)
    assert here.startswith("test_wrapper.py:")


def test_auto_split_trains_like_plain_pytorch(
    monkeypatch: pytest.MonkeyPatch, num_devices: int
) -> None:
    """The real RoundPipe/AutoRoundPipe: the same losses and weights as plain PyTorch."""
    import copy
    import sys

    monkeypatch.undo()  # drop the autouse stand-ins: the engine's own classes from here
    from engine import AutoRoundPipe, RoundPipe  # engine/__init__ imports lazily: after undo

    assert sys.modules["engine.roundpipe"].RoundPipe is RoundPipe
    torch.manual_seed(0)
    ref = Net()
    auto = wrapper.wrap_model_to_roundpipe(
        copy.deepcopy(ref), lower_threshold=1024, upper_threshold=60_000, name="net"
    )
    assert isinstance(auto, AutoRoundPipe)
    assert sum(isinstance(m, RoundPipe) for m in auto.model.modules()) == 4  # blocks + mlp
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(auto.optim_parameters(), lr=0.1)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    for step in range(3):
        x = torch.randint(0, 1000, (4, 5), generator=torch.Generator().manual_seed(step))
        expected = ref(x).square().mean()
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got = auto(x).square().mean()
        got.backward()
        auto.step(step_fn, is_async=False)
        torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    auto.synchronize()
    trained = dict(auto.model.named_parameters())
    for name, p in ref.named_parameters():
        key = next(k for k in trained if k.replace("model.", "") == name.replace("model.", ""))
        torch.testing.assert_close(trained[key].detach(), p.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("between", ["nothing", "another backward", "zero_grad"])
def test_auto_split_gradients_after_synchronize_count_once(
    monkeypatch: pytest.MonkeyPatch, between: str, cpu3: int
) -> None:
    """synchronize() shows the loose parameters' gradients in .grad; the next step adds
    them once (a second backward accumulates on top, zero_grad drops them), as in PyTorch.
    The loose ones follow the model's own zero_grad() too; the streamed ones keep theirs
    on the optimizer side, which the wrapper's zero_grad() clears."""
    import copy

    monkeypatch.undo()
    from engine import AutoRoundPipe

    torch.manual_seed(0)
    ref = Net()
    auto = wrapper.wrap_model_to_roundpipe(
        copy.deepcopy(ref), lower_threshold=1024, upper_threshold=60_000, name="net"
    )
    assert isinstance(auto, AutoRoundPipe) and auto._loose_params()  # the norm, the scale
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(auto.optim_parameters(), lr=0.1)
    x = torch.randint(0, 1000, (4, 5), generator=torch.Generator().manual_seed(0))
    for model in (ref, auto):
        model(x).square().mean().backward()
    auto.synchronize()
    for name, p in auto.model.named_parameters():  # the gradients, as in PyTorch
        ref_p = dict(ref.named_parameters())[name.replace("model.", "")]
        torch.testing.assert_close(p.grad, ref_p.grad, rtol=1e-5, atol=1e-6, msg=name)
    if between == "another backward":
        for model in (ref, auto):
            model(x).square().mean().backward()
    elif between == "zero_grad":
        ref.zero_grad()
        auto.zero_grad()
    ref_opt.step()
    auto.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    auto.synchronize()
    trained = dict(auto.model.named_parameters())
    for name, p in ref.named_parameters():
        key = next(k for k in trained if k.replace("model.", "") == name.replace("model.", ""))
        torch.testing.assert_close(trained[key].detach(), p.detach(), rtol=1e-5, atol=1e-6)
