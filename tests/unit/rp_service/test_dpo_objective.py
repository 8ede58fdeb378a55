"""DPO through RoundPipe against a plain-PyTorch DPO written from the paper's formula.

The oracle is the HF model (or peft's LoRA twin of it) called on the whole batch: full
logits, log_softmax, the completion tokens' log-probabilities summed per row, and
-(1 - eps) log sigmoid(z) - eps log sigmoid(-z) with z = beta ((pi_w - ref_w) - (pi_l -
ref_l)) averaged over pairs. The reference is the initial model for full fine-tuning (a
forward-only pass before training) and the same model with the adapters off for LoRA
(peft's `disable_adapter`). Losses, metrics, gradients and the weights after three Adam
steps agree in fp32, synchronous and asynchronous (staleness-1) steps alike.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from engine import RoundPipeRunConfig, wrap_model_to_roundpipe
from engine.adapters.lora import LoraConfig, adapters_disabled, lora_modules
from engine.adapters.peft_format import adapter_state_dict, load_adapter_state_dict
from rp_service.worker.objectives import dpo
from tests import tiny_models
from tests.unit.engine.conftest import use_devices

transformers = pytest.importorskip("transformers")

VOCAB, PAIRS, SEQ = 256, 5, 11  # odd sizes; 5 pairs over 3 micro-batches: 2, 2, 1
RTOL, ATOL = 1e-5, 1e-6
# Adam divides by sqrt(v) ~ |g|: a gradient rounding difference near eps moves an update
# by up to ~lr * 1e-2 (see tests/unit/engine/models/test_models._adamw); lr 5e-4 keeps it < 1e-5.
LR, WEIGHT_ATOL = 5e-4, 1e-5
STEPS = 3
RANK, ALPHA = 4, 8.0


@pytest.fixture(autouse=True)
def cpu3() -> Iterator[int]:
    yield from use_devices("cpu:3", 3)


def tiny_qwen3() -> nn.Module:
    return tiny_models.tiny_model(
        "qwen3",
        vocab_size=VOCAB,
        num_hidden_layers=3,
        max_position_embeddings=64,
        **tiny_models.WIDE,
    )


def pair_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows 2i / 2i+1: a shared prompt, then different completions, right-padded."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2 * PAIRS, SEQ), generator=gen)
    targets = torch.full_like(ids, -100)
    for i in range(PAIRS):
        prompt = 2 + i % 3
        ids[2 * i + 1, :prompt] = ids[2 * i, :prompt]
        for row, length in ((2 * i, SEQ - i % 2), (2 * i + 1, SEQ - 2 * (i % 3))):
            ids[row, length:] = 0  # padding after the row's last token
            # position t predicts token t + 1; the completion starts after the prompt
            targets[row, prompt - 1 : length - 1] = ids[row, prompt:length]
    return ids, targets


def plain_logps(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logp = model(input_ids=ids).logits.float().log_softmax(-1)  # (rows, seq, vocab)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (targets != -100)).sum(-1)


def plain_dpo(policy: torch.Tensor, ref: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """The paper's loss, batch mean, with cDPO's label smoothing eps."""
    pw, pl = policy[0::2], policy[1::2]
    rw, rl = ref[0::2], ref[1::2]
    z = beta * ((pw - rw) - (pl - rl))
    return (-(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)).mean()


def rp_dpo_step(
    rp: Any, ids: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor, beta: float, eps: float
) -> tuple[float, dict[str, float]]:
    counts = dpo.pair_counts(PAIRS, 3)
    values = rp.forward_backward(
        input_kwargs={"input_ids": ids, "return_logits": False},
        label=(targets, ref),
        loss_fn=dpo.dpo_loss_fn(beta=beta, label_smoothing=eps, num_pairs=PAIRS, chunk_tokens=7),
        run_config=RoundPipeRunConfig(
            num_microbatch=len(counts),
            split_input=dpo.split_rows(counts),
            split_label=dpo.split_label(counts),
        ),
    )
    return dpo.metrics_of(values)


class _Stale:
    """The async step's oracle: step k's gradient at the weights from before step k-1."""

    def __init__(self, params: list[nn.Parameter], on: bool) -> None:
        self.params, self.on = params, on
        self.prev = [p.detach().clone() for p in params]

    def __enter__(self) -> None:
        self.now = [p.detach().clone() for p in self.params]
        if self.on:
            with torch.no_grad():
                for p, w in zip(self.params, self.prev, strict=True):
                    p.copy_(w)

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for p, w in zip(self.params, self.now, strict=True):
                p.copy_(w)
        self.prev = self.now


def test_pair_counts_cut_on_pair_boundaries() -> None:
    assert dpo.pair_counts(5, 3) == [2, 2, 1]
    assert dpo.pair_counts(2, 8) == [1, 1]
    assert dpo.pair_counts(32, 4) == [8, 8, 8, 8]
    ids = torch.arange(10).view(10, 1)
    parts = dpo.split_rows([2, 2, 1])((), {"input_ids": ids, "return_logits": False}, 3)
    assert [p[1]["input_ids"].view(-1).tolist() for p in parts] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    assert all(p[1]["return_logits"] is False for p in parts)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("beta", "eps"), [(0.1, 0.0), (0.5, 0.2)])
def test_full_dpo_matches_plain_pytorch(beta: float, eps: float, is_async: bool) -> None:
    oracle = tiny_qwen3()
    mine = copy.deepcopy(oracle)
    rp = wrap_model_to_roundpipe(mine, optim_dtype=torch.float32)
    params = list(oracle.parameters())
    oracle_opt = torch.optim.Adam(params, lr=LR)
    opt = torch.optim.Adam(list(rp.optim_parameters()), lr=LR)
    batches = [pair_batch(30 + s) for s in range(STEPS)]

    # The reference: the initial model, one forward-only pass before training.
    with torch.no_grad():
        expected_refs = [plain_logps(oracle, ids, t) for ids, t in batches]
    refs = [dpo.sequence_logps(rp, ids, t, num_microbatch=3, chunk_tokens=7) for ids, t in batches]
    for got, want in zip(refs, expected_refs, strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    stale = _Stale(params, is_async)
    for step, ((ids, targets), ref) in enumerate(zip(batches, refs, strict=True)):
        with stale:
            policy = plain_logps(oracle, ids, targets)
            expected = plain_dpo(policy, expected_refs[step], beta, eps)
            expected.backward()
        loss, metrics = rp_dpo_step(rp, ids, targets, ref, beta, eps)
        torch.testing.assert_close(torch.tensor(loss), expected.detach(), rtol=RTOL, atol=ATOL)
        if step == 0:
            assert loss == pytest.approx(math.log(2), abs=1e-6)  # policy == reference
            rp.synchronize()
            for name, p in mine.named_parameters():
                torch.testing.assert_close(
                    p.grad, oracle.get_parameter(name).grad, rtol=RTOL, atol=ATOL, msg=name
                )
        _check_metrics(metrics, policy.detach(), expected_refs[step], beta)
        oracle_opt.step()
        oracle_opt.zero_grad()
        rp.step(step_fn, is_async=is_async)
    rp.synchronize()
    trained = dict(mine.named_parameters())
    for name, p in oracle.named_parameters():
        torch.testing.assert_close(trained[name].detach(), p.detach(), rtol=RTOL, atol=WEIGHT_ATOL)


def _check_metrics(
    metrics: dict[str, float], policy: torch.Tensor, ref: torch.Tensor, beta: float
) -> None:
    chosen = beta * (policy[0::2] - ref[0::2])
    rejected = beta * (policy[1::2] - ref[1::2])
    want = {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).float().mean(),
        "rewards/margins": (chosen - rejected).mean(),
        "logps/chosen": policy[0::2].mean(),
        "logps/rejected": policy[1::2].mean(),
    }
    assert list(metrics) == list(dpo.METRIC_NAMES)
    for key, value in want.items():
        assert metrics[key] == pytest.approx(float(value), rel=1e-5, abs=1e-5), key


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_lora_dpo_matches_plain_pytorch_with_adapters_off_as_reference(is_async: bool) -> None:
    peft = pytest.importorskip("peft")
    beta, eps = 0.2, 0.1
    hf = tiny_qwen3()
    oracle = peft.get_peft_model(
        copy.deepcopy(hf),
        peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # non-zero B: the policy differs from the reference at step 0
        for name, p in oracle.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    rp = wrap_model_to_roundpipe(
        hf,
        lora_config=LoraConfig(
            rank=RANK, alpha=ALPHA, target_modules=("q_proj", "v_proj", "down_proj")
        ),
        optim_dtype=torch.float32,
    )
    load_adapter_state_dict(rp, peft.get_peft_model_state_dict(oracle))
    params = [p for p in oracle.parameters() if p.requires_grad]
    oracle_opt = torch.optim.Adam(params, lr=LR)
    opt = torch.optim.Adam(list(rp.optim_parameters()), lr=LR)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    stale = _Stale(params, is_async)
    for step in range(STEPS):
        ids, targets = pair_batch(40 + step)
        with torch.no_grad(), oracle.disable_adapter():
            expected_ref = plain_logps(oracle, ids, targets)
        with adapters_disabled(rp):  # the same step: a forward without gradients
            ref = dpo.sequence_logps(rp, ids, targets, num_microbatch=3, chunk_tokens=7)
        torch.testing.assert_close(ref, expected_ref, rtol=RTOL, atol=ATOL)
        with stale:
            policy = plain_logps(oracle, ids, targets)
            expected = plain_dpo(policy, expected_ref, beta, eps)
            expected.backward()
        loss, metrics = rp_dpo_step(rp, ids, targets, ref, beta, eps)
        torch.testing.assert_close(torch.tensor(loss), expected.detach(), rtol=RTOL, atol=ATOL)
        _check_metrics(metrics, policy.detach(), expected_ref, beta)
        if step == 0:
            assert abs(loss - math.log(2)) > 1e-3  # the adapters are on in the policy
            rp.synchronize()
            mods = dict(lora_modules(rp))
            for name, p in oracle.named_parameters():
                if not p.requires_grad:
                    continue
                module, part = (
                    name.removeprefix("base_model.model.")
                    .replace(".default", "")
                    .rsplit(".", 2)[:2]
                )
                got = getattr(mods[module], part).weight.grad
                torch.testing.assert_close(got, p.grad, rtol=RTOL, atol=ATOL, msg=name)
        oracle_opt.step()
        oracle_opt.zero_grad()
        rp.step(step_fn, is_async=is_async)
    rp.synchronize()
    want = {n.replace(".default.", "."): p for n, p in oracle.named_parameters() if p.requires_grad}
    got = adapter_state_dict(rp)
    assert got.keys() == want.keys()
    for key, p in want.items():
        torch.testing.assert_close(got[key], p.detach(), rtol=RTOL, atol=WEIGHT_ATOL, msg=key)


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0, 5.0])
def test_first_lora_loss_is_ln2_for_every_beta(beta: float) -> None:
    hf = tiny_qwen3()
    rp = wrap_model_to_roundpipe(
        hf, lora_config=LoraConfig(rank=RANK, alpha=ALPHA), optim_dtype=torch.float32
    )
    ids, targets = pair_batch(7)
    with adapters_disabled(rp):
        ref = dpo.sequence_logps(rp, ids, targets, num_microbatch=3)
    loss, metrics = rp_dpo_step(rp, ids, targets, ref, beta, 0.0)
    assert loss == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["rewards/margins"] == pytest.approx(0.0, abs=1e-6)


def test_adapters_disabled_is_the_base_model_and_ends_with_the_block() -> None:
    hf = tiny_qwen3()
    base = copy.deepcopy(hf)
    rp = wrap_model_to_roundpipe(
        hf, lora_config=LoraConfig(rank=RANK, alpha=ALPHA), optim_dtype=torch.float32
    )
    with torch.no_grad():
        for _, module in lora_modules(rp):
            module.lora_B.weight.normal_(0, 0.1)
    ids, targets = pair_batch(3)
    with torch.no_grad():
        want = plain_logps(base, ids, targets)
    with adapters_disabled(rp):
        off = dpo.sequence_logps(rp, ids, targets, num_microbatch=2)
    on = dpo.sequence_logps(rp, ids, targets, num_microbatch=2)
    torch.testing.assert_close(off, want, rtol=RTOL, atol=ATOL)
    assert (on - want).abs().max() > 1e-3


def test_output_fn_refuses_a_forward_with_gradients() -> None:
    from engine import ConfigError

    rp = wrap_model_to_roundpipe(tiny_qwen3(), optim_dtype=torch.float32)
    ids, _ = pair_batch(1)
    config = RoundPipeRunConfig(output_fn=lambda out, mb: out)
    with pytest.raises(ConfigError, match="output_fn"):
        rp.forward(input_ids=ids, return_logits=False, roundpipe_run_config=config)


def test_the_bench_runs_tiny_on_the_cpu() -> None:
    pytest.importorskip("peft")
    from bench import dpo as bench

    engine_dpo, engine_sft, baseline, summary = bench.main(["--tiny", "--baseline"])
    assert [r["run"] for r in (engine_dpo, engine_sft, baseline, summary)] == [
        "engine-dpo",
        "engine-sft",
        "peft-dpo",
        "summary",
    ]
    assert all(r["tokens_per_s"] > 0 for r in (engine_dpo, engine_sft, baseline))
    # the first DPO step: the adapters start at zero, the policy is the reference
    assert engine_dpo["losses"][0] == pytest.approx(math.log(2), abs=1e-4)
    assert baseline["losses"][0] == pytest.approx(math.log(2), abs=1e-4)
    assert summary["vs_engine_sft"] > 0 and summary["vs_peft_dpo"] > 0


def test_dpo_on_a_4bit_base_matches_peft_on_the_decoded_base() -> None:
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes.functional")
    from engine.adapters.nf4 import quantize_base_nf4
    from tests.unit.engine.adapters.test_qlora import decoded_twin

    beta, eps = 0.3, 0.0
    original = tiny_qwen3()
    hf = copy.deepcopy(original)
    quantize_base_nf4(hf)
    targets = ["q_proj", "v_proj", "down_proj"]
    oracle = peft.get_peft_model(
        decoded_twin(hf, original),
        peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets),
    )
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in oracle.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    rp = wrap_model_to_roundpipe(
        hf,
        lora_config=LoraConfig(rank=RANK, alpha=ALPHA, target_modules=tuple(targets)),
        optim_dtype=torch.float32,
    )
    load_adapter_state_dict(rp, peft.get_peft_model_state_dict(oracle))
    ids, targets_t = pair_batch(50)
    with torch.no_grad(), oracle.disable_adapter():
        expected_ref = plain_logps(oracle, ids, targets_t)
    with adapters_disabled(rp):
        ref = dpo.sequence_logps(rp, ids, targets_t, num_microbatch=3)
    torch.testing.assert_close(ref, expected_ref, rtol=RTOL, atol=1e-5)
    policy = plain_logps(oracle, ids, targets_t)
    expected = plain_dpo(policy, expected_ref, beta, eps)
    loss, _ = rp_dpo_step(rp, ids, targets_t, ref, beta, eps)
    torch.testing.assert_close(torch.tensor(loss), expected.detach(), rtol=RTOL, atol=ATOL)
    assert abs(loss - math.log(2)) > 1e-3
