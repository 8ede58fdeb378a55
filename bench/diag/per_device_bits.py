"""Does one compiled decoder layer (and the compiled loss) give the same bits on every GPU?

Issue 43: the replay tests' runs differ between device counts because a layer's result
depends on which GPU ran it. This runs the presets' compiled decoder call and the chunked
loss's compiled functions, forward and backward, on each visible GPU with the same inputs,
and prints one JSON line per tensor: equal to cuda:0's bits or not. Run it in a fresh
process per setting (inductor's caches per device), e.g.
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python bench/diag/per_device_bits.py
    TORCHINDUCTOR_DETERMINISTIC=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python ...
`--threads` compiles on all GPUs at once from one thread each, as the engine's device
threads do.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.models._compile import compile_for_devices
from engine.models._layer_calls import _compiled_decoder_call
from engine.models.loss import grad_logits_of_chunk, lse_and_loss_of_chunk
from tests.tiny_models import WIDE, tiny_model


def run_on(
    device: torch.device,
    layer0: torch.nn.Module,
    rotary: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    loss_fns: tuple,
) -> dict[str, torch.Tensor]:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    layer = copy.deepcopy(layer0).to(device)
    hidden = inputs["hidden"].to(device).requires_grad_(True)
    positions = inputs["positions"].to(device)
    cos, sin = rotary.to(device)(hidden, positions)
    out = _compiled_decoder_call()(layer, hidden, None, positions, cos, sin, None)
    out.backward(inputs["grad_out"].to(device))
    got = {"out": out.detach(), "grad_hidden": hidden.grad}
    got.update({f"grad.{n}": p.grad for n, p in layer.named_parameters()})
    lse_fn, grad_fn = loss_fns
    logits = inputs["logits"].to(device)
    targets = inputs["targets"].to(device)
    lse, total = lse_fn(logits, targets, -100)
    got["lse"], got["loss"] = lse, total
    got["grad_logits"] = grad_fn(logits, lse, targets, torch.tensor(0.01, device=device), -100)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {k: v.detach().cpu() for k, v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", action="store_true")
    ap.add_argument("--tokens", type=int, default=7 * 64)
    ap.add_argument("--wide", type=int, default=0, help="hidden size (0: the tests' WIDE)")
    args = ap.parse_args()
    b = torch.backends.cuda
    b.enable_flash_sdp(False), b.enable_mem_efficient_sdp(False), b.enable_cudnn_sdp(False)
    shape = (
        dict(WIDE)
        if not args.wide
        else {
            "hidden_size": args.wide,
            "intermediate_size": 3 * args.wide,
            "head_dim": 128,
            "num_attention_heads": args.wide // 128,
            "num_key_value_heads": max(1, args.wide // 512),
        }
    )
    model = tiny_model("qwen3", vocab_size=96, num_hidden_layers=2, dtype=torch.float16, **shape)
    layer0 = model.model.layers[1]
    rotary = model.model.rotary_emb
    g = torch.Generator().manual_seed(0)
    rows, seq = 7, args.tokens // 7
    h = shape["hidden_size"]
    inputs = {
        "hidden": torch.randn(rows, seq, h, generator=g).half(),
        "grad_out": torch.randn(rows, seq, h, generator=g).half() * 0.01,
        "positions": torch.arange(seq).unsqueeze(0).expand(rows, seq).contiguous(),
        "logits": torch.randn(rows * seq, 96, generator=g).half() * 3,
        "targets": torch.randint(0, 96, (rows * seq,), generator=g),
    }
    loss_fns = (
        compile_for_devices(lse_and_loss_of_chunk),
        compile_for_devices(grad_logits_of_chunk),
    )
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if not devices:  # a dry run of the script on the CPU (eager: HALF_DTYPES compile on CUDA only)
        devices = [torch.device("cpu")] * 2
    results: dict[int, dict[str, torch.Tensor]] = {}
    if args.threads:

        def work(d: torch.device) -> None:
            results[len(results)] = run_on(d, layer0, copy.deepcopy(rotary), inputs, loss_fns)

        ts = [threading.Thread(target=work, args=(d,)) for d in devices]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    else:
        for d in devices:
            results[len(results)] = run_on(d, layer0, copy.deepcopy(rotary), inputs, loss_fns)
    # twice on device 0: the run-to-run noise
    again = run_on(devices[0], layer0, copy.deepcopy(rotary), inputs, loss_fns)
    setting = {
        "deterministic": os.environ.get("TORCHINDUCTOR_DETERMINISTIC", "0"),
        "threads": args.threads,
        "tokens": args.tokens,
        "hidden": h,
    }
    for name, ref in results[0].items():
        row = {"tensor": name, **setting, "rerun_equal": bool(torch.equal(ref, again[name]))}
        for i, res in results.items():
            if i:
                row[f"cuda{i}_equal"] = bool(torch.equal(ref, res[name]))
                row[f"cuda{i}_maxdiff"] = float((ref.float() - res[name].float()).abs().max())
        print(json.dumps({"per_device_bits": row}), flush=True)


if __name__ == "__main__":
    main()
