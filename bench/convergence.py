"""What each optimizer step mode costs in convergence: pretrain, then fine-tune on another
distribution, plain PyTorch against the engine's synchronous step, its staleness-one
asynchronous step and its staleness-zero step (the daemon's default).

A tiny Qwen3 (bytes as tokens) is pretrained with plain PyTorch on the demo's stories, then
fine-tuned from that same start on a shifted distribution (`strong`: every word of the
stories reversed; `mild`: the stories in upper case) with the daemon's recipe: AdamW betas
0.9/0.95, gradient clipping at 1.0, linear warm-up then a cosine to zero. Prints one JSON line
per run (final training loss: the mean of the last 20 steps; held-out loss on rows of the
shifted distribution never trained on) and one `summary` line per cell and mode: the mean over
the seeds, its relative difference to plain PyTorch and the spread of that difference.

    python bench/convergence.py                                # CPU, the default cells
    python bench/convergence.py --cells strong:1e-3 --seeds 0 1 2 --steps 200
    RP_DEVICES=cuda python bench/convergence.py --hidden 256   # on GPUs

A cell is SHIFT:LR (a full fine-tune) or SHIFT:LR:lora (rank-8 adapters, alpha 16, on every
projection: engine.adapters.lora.apply_lora, seeded the same in every mode, so plain PyTorch
trains the very adapters the engine does, eagerly, with torch's AdamW and clip).

    python bench/convergence.py --cells strong:2e-4:lora strong:1e-3:lora --steps 200
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("plain", "sync", "staleness1", "staleness0")
DEFAULT_CELLS = ("strong:1e-4", "strong:1e-3", "mild:1e-3")
TAIL = 20


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", nargs="+", default=list(DEFAULT_CELLS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--steps", type=int, default=120, help="fine-tuning steps")
    p.add_argument("--pretrain-steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--num-microbatch", type=int, default=2)
    return p.parse_args()


def _text(shift: str, *, valid: bool) -> str:
    from rp_service.demo import synthetic_records

    stories = " ".join(r["text"] for r in synthetic_records(400, seed=7, valid=valid))
    if shift == "strong":
        return " ".join(word[::-1] for word in stories.split(" "))
    if shift == "mild":
        return stories.upper()
    return stories


def _rows(text: str, seq: int) -> torch.Tensor:
    ids = torch.tensor(list(text.encode()), dtype=torch.long)
    return ids[: len(ids) // seq * seq].view(-1, seq)


def _model(args: argparse.Namespace, seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        use_cache=False,
        tie_word_embeddings=True,
    )
    return transformers.Qwen3ForCausalLM(config)


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then a cosine to zero (the daemon's schedule)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _batches(rows: torch.Tensor, steps: int, batch: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return [rows[torch.randint(0, len(rows), (batch,), generator=gen)] for _ in range(steps)]


def _pretrain(args: argparse.Namespace, seed: int) -> dict[str, torch.Tensor]:
    model = _model(args, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    rows = _rows(_text("none", valid=False), args.seq)
    for ids in _batches(rows, args.pretrain_steps, args.batch, seed):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return copy.deepcopy(model.state_dict())


def _held_out(model: torch.nn.Module, rows: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=rows, labels=rows).loss)


def _plain(
    model: torch.nn.Module, batches: list[torch.Tensor], lr: float, args: Any
) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: _lr_factor(k, len(batches), args.warmup)
    )
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _engine(
    model: torch.nn.Module, batches: list[torch.Tensor], lr: float, args: Any, mode: str
) -> list[float]:
    from engine import RoundPipeRunConfig, wrap_model_to_roundpipe
    from engine.models import causal_lm_loss_fn
    from engine.parallel.data_parallel import grad_norm

    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=True,
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(num_microbatch=args.num_microbatch),
    )
    rp.step_staleness = 0 if mode == "staleness0" else 1
    params = list(rp.optim_parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: _lr_factor(k, len(batches), args.warmup)
    )

    def step_fn() -> None:
        scale = min(1.0, 1.0 / (grad_norm(rp) + 1e-6))
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
        opt.step()
        sched.step()
        opt.zero_grad()

    losses = []
    for ids in batches:
        loss = rp.forward_backward(
            input_kwargs={"input_ids": ids, "return_logits": False},
            label=ids,
            loss_fn=causal_lm_loss_fn(ids),
        )
        losses.append(float(loss))
        rp.step(step_fn, is_async=mode != "sync")
    rp.synchronize()
    return losses


def run_cell(args: argparse.Namespace, cell: str, seed: int, start: dict) -> list[dict]:
    shift, lr_text, *method = cell.split(":")
    lr = float(lr_text)
    lora = method == ["lora"]
    rows = _rows(_text(shift, valid=False), args.seq)
    held = _rows(_text(shift, valid=True), args.seq)[:64]
    batches = _batches(rows, args.steps, args.batch, seed)
    out = []
    for mode in args.modes:
        model = _model(args, seed)
        model.load_state_dict(start)
        if lora:
            from engine.adapters.lora import LoraConfig, apply_lora

            torch.manual_seed(10_000 + seed)  # the same adapters in every mode
            apply_lora(model, LoraConfig(rank=8, alpha=16.0))
        t0 = time.perf_counter()
        if mode == "plain":
            losses = _plain(model, batches, lr, args)
        else:
            losses = _engine(model, batches, lr, args, mode)
        seconds = time.perf_counter() - t0
        model.eval()
        out.append(
            {
                "bench": "convergence",
                "cell": cell,
                "mode": mode,
                "seed": seed,
                "final_loss": statistics.fmean(losses[-TAIL:]),
                "held_out_loss": _held_out(model, held),
                "seconds": round(seconds, 2),
                "curve": [round(v, 4) for v in losses[:: max(1, len(losses) // 20)]],
            }
        )
        print(json.dumps(out[-1]), flush=True)
    return out


def summarise(rows: list[dict]) -> list[dict]:
    """Per cell and mode: the mean over seeds and its relative difference to plain PyTorch
    (with the smallest and largest per-seed difference)."""
    out = []
    for cell in sorted({r["cell"] for r in rows}):
        plain = {r["seed"]: r for r in rows if r["cell"] == cell and r["mode"] == "plain"}
        for mode in [m for m in MODES if m != "plain"]:
            mine = [r for r in rows if r["cell"] == cell and r["mode"] == mode]
            if not mine or not plain:
                continue
            row: dict[str, Any] = {"bench": "convergence.summary", "cell": cell, "mode": mode}
            for key in ("final_loss", "held_out_loss"):
                ref = statistics.fmean(plain[r["seed"]][key] for r in mine)
                got = statistics.fmean(r[key] for r in mine)
                per_seed = [r[key] / plain[r["seed"]][key] - 1 for r in mine]
                row[key] = round(got, 5)
                row[f"{key}_plain"] = round(ref, 5)
                row[f"{key}_vs_plain"] = round(got / ref - 1, 5)
                row[f"{key}_vs_plain_spread"] = [round(min(per_seed), 5), round(max(per_seed), 5)]
            row["seeds"] = len(mine)
            out.append(row)
    return out


def main() -> None:
    args = _parse()
    os.environ.setdefault("RP_DEVICES", "cpu:2")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    rows = []
    for seed in args.seeds:
        start = _pretrain(args, seed)
        for cell in args.cells:
            rows += run_cell(args, cell, seed, start)
    for row in summarise(rows):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
