"""RoundPipe's attribute shim (the seeds' RoundPipeBase): reads fall through to the wrapped
and the original model, writes and deletions are mirrored to them once initialised, and the
wrapper's own attributes stay its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import AutoRoundPipe, RoundPipe


def _wrappers() -> list[tuple[nn.Module, nn.Module]]:
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tree = nn.ModuleDict({"a": nn.Linear(2, 2)})
    return [(RoundPipe(seq), seq), (AutoRoundPipe(tree), tree)]


@pytest.mark.parametrize("index", [0, 1], ids=["RoundPipe", "AutoRoundPipe"])
def test_writes_reach_the_wrapped_model(index: int, cpu3: int) -> None:
    wrapper, wrapped = _wrappers()[index]
    wrapper.var1 = 42
    assert wrapped.var1 == 42 and wrapper.var1 == 42
    wrapped.var1 = 43  # the wrapped model's own writes show through: no stale copy
    assert wrapper.var1 == 43
    del wrapper.var1
    assert not hasattr(wrapped, "var1") and not hasattr(wrapper, "var1")
    with pytest.raises(AttributeError):
        del wrapper.var1


@pytest.mark.parametrize("index", [0, 1], ids=["RoundPipe", "AutoRoundPipe"])
def test_writes_reach_the_original_model(index: int, cpu3: int) -> None:
    wrapper, wrapped = _wrappers()[index]
    original = nn.Linear(3, 3)
    original.vocab_size = 10
    wrapper.set_original_model(original)
    assert wrapper.vocab_size == 10
    wrapper.vocab_size = 12
    wrapper.var2 = "x"
    assert original.vocab_size == 12 and original.var2 == "x" and wrapped.var2 == "x"
    del wrapper.var2
    assert not hasattr(original, "var2") and not hasattr(wrapped, "var2")


def test_the_wrappers_own_attributes_stay_its_own(cpu3: int) -> None:
    seq = nn.Sequential(nn.Linear(2, 2))
    rp = RoundPipe(seq)
    rp.eval()  # nn.Module's own state
    assert rp.training is False and seq.training is False
    rp.name = "renamed"  # set in __init__: the wrapper's
    assert rp.name == "renamed" and not hasattr(seq, "name")
    rp.extra = nn.Linear(2, 2)  # a module registers on the wrapper, as nn.Module does
    assert "extra" in rp._modules and not hasattr(seq, "extra")
    assert rp.num_layers == 1
    with torch.no_grad():
        assert rp(torch.ones(8, 2)).shape == (8, 2)


def test_named_parameters_warn_against_direct_use(cpu3: int) -> None:
    """The seeds' RoundPipeBase.named_parameters "warns against direct use" (the model copy,
    not the optimizer's); parameters() does not, and inside a step_fn both give the
    optimizer-side tensors without a warning."""
    import warnings

    rp = RoundPipe(nn.Sequential(nn.Linear(2, 2)), optim_dtype=torch.float32)
    with pytest.warns(UserWarning, match="optim_parameters"):
        names = [n for n, _ in rp.named_parameters()]
    assert names == ["model.0.weight", "model.0.bias"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(rp.parameters())) == 2
        rp.zero_grad()
        seen: list[list[tuple[str, torch.Tensor]]] = []
        rp.step(lambda: seen.append(list(rp.named_parameters())), is_async=False)
    masters = dict(rp.optim_named_parameters())
    assert [n for n, _ in seen[0]] == list(masters)
    assert all(p is masters[n] for n, p in seen[0])
