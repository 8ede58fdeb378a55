"""LoRA through RoundPipe against the same LoRA model in plain PyTorch via peft.

The oracle is peft on a copy of the HF model (or of an nn.Sequential) with the same
adapter weights (moved across through peft's own state-dict format, which checks the key
mapping too): losses, adapter gradients and three Adam steps equal in fp32, base weights
bit-identical after training; the saved adapter loads with peft, the merged export with
transformers; bad configs are refused with a message that names the problem.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from torch import nn

from engine import ConfigError, RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe
from engine.adapters.lora import (
    DEFAULT_TARGET_MODULES,
    LoraConfig,
    LoraLinear,
    apply_lora,
    count_parameters,
    lora_modules,
)
from engine.adapters.peft_format import adapter_state_dict, load_adapter_state_dict
from engine.attribute import ParamAttribute
from engine.models import causal_lm_loss_fn
from engine.optim import Adam
from tests.unit.engine._models import DIM, IN_DIM, OUT_DIM, MLPBlock, make_batch, make_model
from tests.unit.engine.models.test_models import batch, tiny_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

RTOL, ATOL = 1e-5, 1e-6
# Adam divides by sqrt(v) ~ |g|: rounding differences of ~1e-7 in gradients near eps move
# an update by up to lr * 1e-2 (see test_models._adamw); lr 1e-3 keeps that under 1e-5.
LR, WEIGHT_ATOL = 1e-3, 1e-5
STEPS = 3
RANK, ALPHA = 4, 8.0


def peft_twin(model: nn.Module, targets: tuple[str, ...], seed: int = 7) -> nn.Module:
    """peft's LoRA on a copy of `model`, with random (non-zero) lora_B so that every
    adapter weight gets a gradient from the first step."""
    ref = peft.get_peft_model(
        copy.deepcopy(model),
        peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(targets)),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return ref


def adapter_params(ref: nn.Module) -> dict[str, nn.Parameter]:
    """peft's trainable parameters under the saved key names ('.default' dropped)."""
    return {n.replace(".default.", "."): p for n, p in ref.named_parameters() if p.requires_grad}


def assert_adapters_equal(rp: Any, ref: nn.Module, *, grads: bool, atol: float) -> None:
    expected = adapter_params(ref)
    got = adapter_state_dict(rp)
    assert got.keys() == expected.keys()
    mods = dict(lora_modules(rp))
    for key, p in expected.items():
        if grads:
            name, part = key.removeprefix("base_model.model.").rsplit(".", 2)[:2]
            value = getattr(mods[name], part).weight.grad
            want = p.grad
        else:
            value, want = got[key], p.detach()
        torch.testing.assert_close(value, want, rtol=RTOL, atol=atol, msg=key)


class _Stale:
    """The async step's reference: step k's gradient is taken at the weights from before
    step k-1, w[k+1] = update(w[k], grad L_k(w[k-1])) with w[-1] = w[0]."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.prev = [p.detach().clone() for p in params]

    def __enter__(self) -> None:
        self.now = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, w in zip(self.params, self.prev, strict=True):
                p.copy_(w)

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for p, w in zip(self.params, self.now, strict=True):
                p.copy_(w)
        self.prev = self.now


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("kind", "tie"), [("qwen3", False), ("llama", True)])
def test_lora_trains_like_peft(kind: str, tie: bool, is_async: bool, cpu3: int) -> None:
    hf = tiny_model(kind, tie=tie, layers=3)
    ref = peft_twin(hf, DEFAULT_TARGET_MODULES)
    base_before = {n: p.detach().clone() for n, p in hf.named_parameters()}
    rp = wrap_model_to_roundpipe(
        hf,
        lora_config=LoraConfig(rank=RANK, alpha=ALPHA),
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        optim_dtype=torch.float32,
    )
    assert isinstance(rp, RoundPipe)
    load_adapter_state_dict(rp, peft.get_peft_model_state_dict(ref))
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.Adam(ref_params, lr=LR)
    opt = Adam(rp.optim_parameters(), lr=LR)
    assert len(opt.param_groups[0]["params"]) == len(ref_params) == 2 * 7 * 3
    assert all(p.dtype == torch.float32 for p in rp.optim_parameters())

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    stale = _Stale(ref_params)
    for step in range(STEPS):
        ids, labels = batch(20 + step)
        with stale if is_async else _nothing():
            expected = ref(input_ids=ids, labels=labels).loss
            expected.backward()
        got = rp.forward_backward(
            input_kwargs={"input_ids": ids}, label=labels, loss_fn=causal_lm_loss_fn(labels)
        )
        torch.testing.assert_close(got, expected.detach(), rtol=RTOL, atol=ATOL)
        if step == 0:
            rp.synchronize()
            assert_adapters_equal(rp, ref, grads=True, atol=ATOL)
        ref_opt.step()
        ref_opt.zero_grad()
        rp.step(step_fn, is_async=is_async)
    rp.synchronize()
    assert_adapters_equal(rp, ref, grads=False, atol=WEIGHT_ATOL)

    # The base: untouched bit for bit, and no master, gradient buffer or state for it.
    for name, before in base_before.items():
        p = hf.get_parameter(_base_name(hf, name))
        assert not p.requires_grad
        assert torch.equal(p.detach(), before), name
        attr = ParamAttribute.get(p)
        assert attr.optim is None and attr.grad_host is None, name
        assert p not in opt.state
    assert len(opt.state) == len(ref_params)


class _nothing:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: Any) -> None:
        pass


def _base_name(model: nn.Module, name: str) -> str:
    """The name a pre-LoRA parameter has after apply_lora (base_layer inserted)."""
    module_name, _, leaf = name.rpartition(".")
    if isinstance(model.get_submodule(module_name), LoraLinear):
        return f"{module_name}.base_layer.{leaf}"
    return name


def test_saved_adapter_and_merged_export_give_the_trained_logits(tmp_path: Any, cpu3: int) -> None:
    hf = tiny_model("qwen3", layers=2)
    base = copy.deepcopy(hf)
    rp = wrap_model_to_roundpipe(
        hf,
        lora_config=peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "up_proj"]),
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        optim_dtype=torch.float32,
    )
    opt = Adam(rp.optim_parameters(), lr=1e-2)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    for step in range(2):
        ids, labels = batch(30 + step)
        rp.forward_backward(
            input_kwargs={"input_ids": ids}, label=labels, loss_fn=causal_lm_loss_fn(labels)
        )
        rp.step(step_fn)  # async: save_adapter must see the latest step
    rp.save_adapter(tmp_path / "adapter", merged_path=tmp_path / "merged")
    rp.synchronize()
    ids, _ = batch(40)
    with torch.no_grad():
        trained = rp(input_ids=ids).logits
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter")
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained, rtol=RTOL, atol=ATOL)
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        torch.testing.assert_close(merged(input_ids=ids).logits, trained, rtol=RTOL, atol=1e-5)
        untrained = base(input_ids=ids).logits
    assert not torch.allclose(trained, untrained, atol=1e-3)  # the adapter did something
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (RANK, ALPHA, "LORA")
    assert sorted(cfg["target_modules"]) == ["q_proj", "up_proj"]
    # The merged export has the base model's names and nothing else.
    assert set(merged.state_dict()) == set(base.state_dict())


def test_lora_on_a_plain_sequential_matches_peft(cpu3: int) -> None:
    model = make_model(p_drop=0.0)
    targets = ("qkv", "proj", "up", "down")
    ref = peft_twin(model, targets)
    x, y = make_batch()
    apply_lora(model, LoraConfig(rank=RANK, alpha=ALPHA, target_modules=targets))
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=4))
    load_adapter_state_dict(rp, peft.get_peft_model_state_dict(ref))
    assert count_parameters(rp) == (
        sum(p.numel() for p in ref.parameters() if p.requires_grad),
        sum(p.numel() for p in ref.parameters()),
    )

    def mse(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return ((out - label) ** 2).mean() / 4

    got = rp.forward_backward((x,), label=y, loss_fn=mse)
    expected = ((ref(x) - y) ** 2).mean()
    expected.backward()
    torch.testing.assert_close(got, expected.detach(), rtol=RTOL, atol=ATOL)
    rp.synchronize()
    assert_adapters_equal(rp, ref, grads=True, atol=ATOL)


def test_adapter_state_round_trips_into_optimizer_copies(cpu3: int) -> None:
    hf = tiny_model("llama", layers=1)
    rp = wrap_model_to_roundpipe(hf, lora_config=LoraConfig(rank=2, target_modules=("v_proj",)))
    state = adapter_state_dict(rp)
    assert list(state) == [
        "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight",
    ]
    new = {k: torch.full_like(v, 0.5) for k, v in state.items()}
    load_adapter_state_dict(rp, new)
    for p in rp.optim_parameters():
        assert torch.equal(p, torch.full_like(p, 0.5))
    for value in adapter_state_dict(rp).values():
        assert torch.equal(value, torch.full_like(value, 0.5))
    trainable, total = count_parameters(rp)
    assert trainable == 2 * (64 + 32) and total == sum(p.numel() for p in hf.parameters())


BAD_CONFIGS = [
    ({"rank": 0}, r"lora.rank must be an integer >= 1, got 0"),
    ({"rank": -3}, r"lora.rank must be an integer >= 1"),
    ({"rank": 33}, r"lora.rank=33 exceeds min\(in, out\)=32 of '.*k_proj' \(64 -> 32\)"),
    ({"alpha": 0.0}, r"lora.alpha must be > 0"),
    ({"dropout": 1.0}, r"lora.dropout must be in \[0, 1\)"),
    ({"target_modules": ()}, r"lora.target_modules is empty"),
    (
        {"target_modules": ("q_proj", "qkv_proj")},
        r"no module named 'qkv_proj' in Qwen3ForCausalLM; its linear layers are named "
        r"\['down_proj', 'gate_proj', 'k_proj', 'lm_head'",
    ),
    (
        {"target_modules": ("embed_tokens",)},
        r"'model.embed_tokens' is a Embedding, not an nn.Linear",
    ),
]


@pytest.mark.parametrize(("fields", "message"), BAD_CONFIGS)
def test_bad_configs_are_refused_with_the_reason(fields: dict[str, Any], message: str) -> None:
    hf = tiny_model("qwen3", layers=1)
    before = {n: p.requires_grad for n, p in hf.named_parameters()}
    with pytest.raises(ConfigError, match=message):
        apply_lora(hf, fields)
    # Refused before touching the model.
    assert {n: p.requires_grad for n, p in hf.named_parameters()} == before
    assert not any(isinstance(m, LoraLinear) for m in hf.modules())


def test_peft_options_the_engine_lacks_are_refused() -> None:
    hf = tiny_model("qwen3", layers=1)
    with pytest.raises(ConfigError, match="use_dora=True is not supported"):
        apply_lora(hf, peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ConfigError, match="target_modules is None"):
        apply_lora(hf, peft.LoraConfig(r=2))
    apply_lora(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match="already has LoRA adapters"):
        apply_lora(hf, LoraConfig())


def test_adapter_state_that_does_not_fit_is_refused(cpu3: int) -> None:
    hf = tiny_model("qwen3", layers=1)
    rp = wrap_model_to_roundpipe(hf, lora_config={"rank": 2, "target_modules": ("q_proj",)})
    state = adapter_state_dict(rp)
    key = next(iter(state))
    with pytest.raises(ConfigError, match="missing"):
        load_adapter_state_dict(rp, {key: state[key]})
    wrong = {k: torch.zeros(v.shape[0] + 1, v.shape[1]) for k, v in state.items()}
    with pytest.raises(ConfigError, match=r"has shape \(3, 64\).*\(2, 64\)"):
        load_adapter_state_dict(rp, wrong)
    with pytest.raises(ConfigError, match="no LoRA adapters"):
        adapter_state_dict(tiny_model("qwen3", layers=1))


def test_dropout_runs_unmerged_in_training_and_merged_in_eval(cpu3: int) -> None:
    config = LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.5, target_modules=("q_proj", "up_proj"))
    ids, labels = batch(50)
    # Training: the adapter sees dropout(x) and the base x, so it is not merged on upload.
    rp = wrap_model_to_roundpipe(tiny_model("qwen3", layers=1), lora_config=config)
    loss = rp.forward_backward(
        input_kwargs={"input_ids": ids}, label=labels, loss_fn=causal_lm_loss_fn(labels)
    )
    rp.synchronize()
    assert torch.isfinite(loss)
    replicas = [m for rep in rp._replicas.values() for m in rep.module.modules()]
    merged = [m.merged for m in replicas if isinstance(m, LoraLinear)]
    assert merged and not any(merged)
    assert all(m.lora_A.weight.grad is not None for _, m in lora_modules(rp))
    # Eval (dropout off): merged, and the same logits as peft's model in eval mode.
    hf = tiny_model("qwen3", layers=1).eval()
    ref = peft.get_peft_model(
        copy.deepcopy(hf),
        peft.LoraConfig(
            r=RANK, lora_alpha=ALPHA, lora_dropout=0.5, target_modules=["q_proj", "up_proj"]
        ),
    ).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    rp = wrap_model_to_roundpipe(hf, lora_config=config)
    load_adapter_state_dict(rp, peft.get_peft_model_state_dict(ref))
    with torch.no_grad():
        torch.testing.assert_close(
            rp(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=RTOL, atol=ATOL
        )
    replicas = [m for rep in rp._replicas.values() for m in rep.module.modules()]
    merged = [m.merged for m in replicas if isinstance(m, LoraLinear)]
    assert merged and all(merged)


class _Net(nn.Module):
    """Not one Sequential: the auto-split wraps `blocks` in a RoundPipe, the rest stays."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_DIM, DIM)
        self.blocks = nn.Sequential(MLPBlock(DIM, 0.0), MLPBlock(DIM, 0.0))
        self.out = nn.Linear(DIM, OUT_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def test_lora_through_the_auto_split_keeps_the_model_names(cpu3: int) -> None:
    from engine import AutoRoundPipe

    torch.manual_seed(0)
    net = _Net()
    ref = peft_twin(net, ("up", "down", "out"))
    rp = wrap_model_to_roundpipe(
        net,
        lora_config=LoraConfig(rank=RANK, alpha=ALPHA, target_modules=("up", "down", "out")),
        lower_threshold=1,
        upper_threshold=3000,
    )
    assert isinstance(rp, AutoRoundPipe) and isinstance(rp.model.blocks, RoundPipe)
    # Names without the RoundPipe wrapper's '.model.': peft's state loads as it is.
    load_adapter_state_dict(rp, peft.get_peft_model_state_dict(ref))
    x, y = make_batch()
    got = ((rp(x) - y) ** 2).mean()
    got.backward()
    rp.synchronize()
    expected = ((ref(x) - y) ** 2).mean()
    expected.backward()
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert_adapters_equal(rp, ref, grads=True, atol=ATOL)


def test_the_service_offers_the_engines_target_modules() -> None:
    """The JobSpec's default targets are the engine's: both are the catalog's."""
    from engine.catalog import LORA_TARGET_MODULES
    from rp_service.schemas import LoraSection

    assert LORA_TARGET_MODULES == DEFAULT_TARGET_MODULES
    assert tuple(LoraSection().target_modules) == DEFAULT_TARGET_MODULES
