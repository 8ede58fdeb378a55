"""Chat serving latency: time to first token (cold and warm) and decode tokens/s.

Prints one JSON line per result (issue 31's Performance section):

    python bench/chat_latency.py --shape qwen3-8b --lora        # random Qwen3-8B + LoRA, GPU 0
    python bench/chat_latency.py --model-dir /models/Qwen3-8B --adapter-dir /out/job-x
    python bench/chat_latency.py --tiny                         # the demo's shape, CPU

It drives the daemon's own serving path (rp_service.serving.manager.ServingManager: the
`python -m rp_service.serving` process, transformers' generate, peft's adapters) without
HTTP in front. `cold`: the first request, the process start and the model load included;
`warm`: the same request again on the loaded model (`--repeats` times, median).
`decode_tokens_per_s` counts the tokens after the first over the time after the first
text arrived. Greedy decoding of exactly `--max-tokens` tokens (no end-of-text stop).

Random models (no download): a `--shape` config with weights drawn N(0, 0.02) (norms 1),
saved as a Hugging Face folder with a word-level tokenizer covering the whole vocabulary
(each id decodes to a word, so every token streams as text) and a ChatML chat template;
`--lora` adds a random rank-16 adapter on every projection (peft's format).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shapes import config_fields, fill_random

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {**config_fields("qwen3-8b"), "max_position_embeddings": 40960},
    # rp_service/demo/demo_spec.json's model
    "tiny": {
        "hidden_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "intermediate_size": 256,
        "vocab_size": 264,
        "max_position_embeddings": 512,
    },
}
_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
PROMPT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Explain in a few sentences why the sky is blue."},
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tiny", action="store_true", help="the demo's shape on the CPU, short")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--model-dir", type=Path, help="a model folder instead of a random model")
    p.add_argument("--adapter-dir", type=Path, help="a PEFT adapter folder on --model-dir")
    p.add_argument("--lora", action="store_true", help="a random LoRA adapter (random model)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", type=Path, help="where the random model is written")
    p.add_argument("--cpu", action="store_true", help="serve on the CPU even with a GPU")
    p.add_argument(
        "--direct",
        action="store_true",
        help="also time transformers' generate in this process (dynamic and static KV cache), "
        "without the serving process: what the serving path costs on top",
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.cpu = "tiny", True
        args.max_tokens = min(args.max_tokens, 32)
    return args


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level fast tokenizer over `vocab_size` ids ("w0", "w1", ...; the last ids are
    ChatML's special tokens) with ChatML as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rp_service.data.tokenizer import CHAT_TEMPLATE

    words = vocab_size - len(_SPECIALS)
    vocab = {f"w{i}": i for i in range(words)}
    vocab.update({s: words + k for k, s in enumerate(_SPECIALS)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=_SPECIALS[0],
        pad_token=_SPECIALS[3],
        additional_special_tokens=list(_SPECIALS[1:3]),
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def random_model(folder: Path, shape: str, *, lora: bool) -> Path | None:
    """Write a random model of `shape` (and a LoRA adapter) under `folder`; return the
    adapter folder (None without `lora`)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES[shape], tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")  # bf16 from the start: 16 GB, not 48
    fill_random(model, seed=0)  # at memory speed: drawing 8B normals one by one takes minutes
    generator = torch.Generator().manual_seed(0)
    model.generation_config.eos_token_id = None  # decode exactly --max-tokens tokens
    model.save_pretrained(folder / "model")
    word_tokenizer(config.vocab_size).save_pretrained(folder / "model")
    if not lora:
        return None
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # peft starts B at 0: a no-op adapter would measure nothing
                param.normal_(0.0, 0.02, generator=generator)
    peft_model.save_pretrained(folder / "adapter")
    return folder / "adapter"


class _Pool:
    """GPU 0 for the serving process (the daemon's orchestrator lends one the same way)."""

    def __init__(self, gpus: list[int]) -> None:
        self.gpu_ids = gpus
        self.lent: set[int] = set()
        self.gpus_wanted: Any = None
        self.job_deleted: Any = None

    def lend_gpu(self) -> int | None:
        free = [g for g in self.gpu_ids if g not in self.lent]
        if free:
            self.lent.add(free[0])
            return free[0]
        return None

    def return_gpu(self, gpu: int) -> None:
        self.lent.discard(gpu)

    def gpu_jobs(self) -> dict[int, str]:
        return {}

    def worker_host_bytes(self) -> dict[str, int]:
        return {}  # no training workers beside the bench's serving process


async def _one(manager: Any, served: Any, max_tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    first_s: float | None = None
    done: dict[str, Any] = {}
    payload = {
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "top_p": None,
        "seed": None,
        "stop": [],
    }
    async for message in manager.generate(served, payload):
        if message["type"] == "delta" and first_s is None:
            first_s = time.perf_counter() - started
        elif message["type"] == "error":
            raise RuntimeError(message["message"])
        elif message["type"] == "done":
            done = message
    total_s = time.perf_counter() - started
    tokens = int(done["completion_tokens"])
    assert first_s is not None, "no text came back"
    decode_s = total_s - first_s
    return {
        "ttft_s": round(first_s, 4),
        "total_s": round(total_s, 4),
        "prompt_tokens": int(done["prompt_tokens"]),
        "completion_tokens": tokens,
        "decode_tokens_per_s": round((tokens - 1) / decode_s, 2) if decode_s > 0 else None,
    }


async def _run(args: argparse.Namespace, model_dir: Path, adapter: Path | None) -> list[dict]:
    import torch

    from rp_service.serving.manager import ServingManager
    from rp_service.serving.models import BaseModel, ServedModel
    from rp_service.settings import Settings

    gpus = [] if args.cpu or not torch.cuda.is_available() else [0]
    with tempfile.TemporaryDirectory() as data:
        manager = ServingManager(Settings(data_dir=Path(data), gpus="none"), _Pool(gpus))
        served = ServedModel(
            id="bench",
            base=BaseModel(path=str(model_dir)),
            adapter=None if adapter is None else str(adapter),
            tokenizer=str(model_dir),
        )
        common = {
            "bench": "chat_latency",
            "model": str(args.model_dir) if args.model_dir else f"random-{args.shape}",
            "adapter": adapter is not None,
            "device": "cpu" if not gpus else torch.cuda.get_device_name(0),
            "max_tokens": args.max_tokens,
        }
        rows = []
        try:
            cold = await _one(manager, served, args.max_tokens)
            process = manager.process_of(served.base)
            load_s = process.ready.result().get("load_s") if process and process.ready else None
            rows.append({**common, "phase": "cold", "load_s": load_s, **cold})
            warm = [await _one(manager, served, args.max_tokens) for _ in range(args.repeats)]
            rows.append(
                {
                    **common,
                    "phase": "warm",
                    "repeats": args.repeats,
                    "ttft_s": statistics.median(r["ttft_s"] for r in warm),
                    "decode_tokens_per_s": statistics.median(
                        r["decode_tokens_per_s"] or 0.0 for r in warm
                    ),
                    "completion_tokens": warm[-1]["completion_tokens"],
                    "prompt_tokens": warm[-1]["prompt_tokens"],
                }
            )
        finally:
            await manager.stop()
    return rows


def direct_generate(model_dir: Path, max_tokens: int, *, cpu: bool) -> list[dict[str, Any]]:
    """Greedy `generate` of `max_tokens` tokens on the base in this process, timed after a
    short warm-up, with the dynamic and the static KV cache."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cpu" if cpu or not torch.cuda.is_available() else "cuda:0"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    text = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]], device=device)
    rows = []
    for cache in ("dynamic", "static"):
        extra = {} if cache == "dynamic" else {"cache_implementation": "static"}

        def run(n: int, extra: dict[str, Any] = extra) -> float:
            started = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=0,
                    **extra,
                )
            if device != "cpu":
                torch.cuda.synchronize()
            assert out.shape[1] == ids.shape[1] + n
            return time.perf_counter() - started

        first = run(max_tokens)  # warm-up (and, for the static cache, its compile)
        elapsed = run(max_tokens)
        rows.append(
            {
                "bench": "chat_latency",
                "phase": f"direct-{cache}",
                "device": device,
                "first_run_s": round(first, 3),
                "tokens_per_s": round(max_tokens / elapsed, 2),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        if args.model_dir is not None:
            model_dir, adapter = args.model_dir, args.adapter_dir
        else:
            started = time.perf_counter()
            adapter = random_model(Path(work), args.shape, lora=args.lora or args.tiny)
            model_dir = Path(work) / "model"
            print(
                json.dumps({"bench": "chat_latency", "built_s": time.perf_counter() - started}),
                file=sys.stderr,
            )
        rows = asyncio.run(_run(args, model_dir, adapter))
        if args.direct:
            rows += direct_generate(model_dir, args.max_tokens, cpu=args.cpu)
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
