"""GRPO step time: the engine's LoRA GRPO step beside TRL's GRPOTrainer (no vLLM).

Prints one JSON line per run, then a summary (issue 48's Performance section):

    python bench/grpo.py --model qwen3-8b                  # 32 prompts x 8, 512 tokens
    python bench/grpo.py --model qwen3-8b --runs engine    # the engine alone
    python bench/grpo.py --model qwen3-8b --runs engine --sampler streamed
    python bench/grpo.py --model qwen3-8b --runs engine --sampler eager
    python bench/grpo.py --model llama-70b --nf4 --runs engine --prompts 4 \
        --completion-len 32 --steps 1                      # the 70B NF4 recipe, streamed
    RP_DEVICES=cpu:1 python bench/grpo.py --tiny           # CPU self-check, both runs

Weights are random bf16 (no download), LoRA rank 16 (alpha 32) on every projection. The
tokenizer is a word-level one over the model's whole vocabulary (`t0` .. `tN`, built here:
nothing to download), so TRL can decode and re-encode the completions. Each prompt is
`--prompt-len` random tokens; a step is `--prompts` prompts x `--group` completions of at
most `--completion-len` tokens at temperature 1 (random weights almost never draw the
end-of-text token: completions run to the limit in both runs). The reward is a cheap
string check (1 when the completion holds the token `t1`), so grading is a small share,
as with the string graders; the point is sampling and training.

Each run goes in its own subprocess (`--run`), so the host and GPU peaks are its own:

- `engine`: the job's pieces as the worker calls them: the rollout sampler placed as a
  job places it (`rp_service.worker.generation.make_sampler`: a KV-cached batched
  generate on a GPU-resident copy, the adapters refreshed each step, its decode step
  replayed as a CUDA graph, `graph_decode`; `--sampler eager` for the A/B; where the copy does
  not fit, or with `--sampler streamed`, the decoder layers streamed from host memory at
  every token, `streamed_generation`), the grader, then the GRPO loss through the engine
  (`forward_backward`, layers streamed from host memory) and the engine's Adam. `--nf4`
  packs the base's decoder linears in NF4 (the 70B recipe: `--model llama-70b --nf4`);
- `trl`: `trl.GRPOTrainer` with a peft LoRA of the same rank and targets, bf16, gradient
  checkpointing, transformers' `generate` (no vLLM: it cannot be carried to the device),
  `per_device_train_batch_size` `--trl-micro` completions, gradient accumulation to the same
  `prompts x group` completions a step, `num_iterations` 1, `beta` 0 (TRL's defaults).

Fields: `step_s` (mean over the measured steps), `sampling_s`, `grading_s`, `training_s`
(the rest of the step), `rollout_tokens_per_s` (completion tokens / sampling seconds),
`steps_per_hour`, `gpu_peak_gib` (allocated), `gpu_reserved_gib` and `host_peak_gib`
(RSS); the engine run adds `sampler_placement` (resident, per_step, packed or streamed) and,
streamed or packed, `sampler_device_gib` (the
weights it holds at most), `uploaded_gib` (a step's layer uploads) and `upload_gb_per_s`
(those over the sampling time: the host link's rate, what a streamed decode step waits on). trl is a dev extra here; on the device machine it may be missing: the run's line
then says so (carry the wheel: docs/RL.md, "The benchmark").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.qlora import SHAPES, build_model, gpu_peak_gib, gpu_reserved_peak_gib, host_peak_gib

_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_REWARD_TOKEN = "t1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU, short")
    p.add_argument("--prompts", type=int, default=32, help="prompts a step")
    p.add_argument("--group", type=int, default=8, help="completions a prompt")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=512)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--num-microbatch", type=int, default=8, help="the engine's micro-batches")
    p.add_argument("--trl-micro", type=int, default=8, help="TRL's completions a micro-batch")
    p.add_argument("--steps", type=int, default=2, help="measured steps")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured first steps")
    p.add_argument(
        "--runs",
        default="engine,trl",
        help="which runs, comma-separated (engine, trl): one each per 10-minute device call",
    )
    p.add_argument(
        "--sampler",
        choices=["auto", "streamed", "eager"],
        default="auto",
        help="the engine run's rollout sampler: placed by size as a job does (auto: a copy "
        "on the GPU replays its decode step as a CUDA graph), the decoder layers streamed "
        "from host memory even where a copy fits (streamed), or auto with the copy decoding "
        "eagerly (eager: RP_GRAPH_ROLLOUTS=0, the A/B of the replay)",
    )
    p.add_argument(
        "--merged-adapters",
        action="store_true",
        help="the engine run's sampler copy carries the LoRA adapters merged into its base "
        "weights, uploaded again at each refresh (RP_MERGED_ROLLOUTS=1)",
    )
    p.add_argument("--nf4", action="store_true", help="the engine run's base packed in NF4")
    p.add_argument("--run", choices=["engine", "trl"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.model = "tiny"
        args.prompts, args.group, args.prompt_len, args.completion_len = 4, 4, 8, 16
        args.num_microbatch, args.trl_micro, args.steps, args.warmup = 2, 4, 2, 1
    args.seq_len = args.prompt_len + args.completion_len  # what build_model sizes by
    return args


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer whose tokens are `t0` .. `t{vocab_size - 1}`; `t0` pads and
    ends text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="t0", pad_token="t0", unk_token="t0"
    )


def prompt_ids(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (args.prompts, args.prompt_len), generator=gen)
    return ids.tolist()


def _text(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


_START = time.perf_counter()


def progress(message: str) -> None:
    """One line on stderr with the seconds since the run began."""
    print(
        f"[grpo bench {time.perf_counter() - _START:7.1f} s] {message}", file=sys.stderr, flush=True
    )


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _summary(args: argparse.Namespace, run: str, phases: list[dict[str, float]]) -> dict:
    measured = phases[args.warmup :]
    n = max(len(measured), 1)

    def mean(key: str) -> float:
        return sum(p[key] for p in measured) / n

    step = mean("step")
    return {
        "run": run,
        "step_s": round(step, 3),
        "sampling_s": round(mean("sampling"), 3),
        "grading_s": round(mean("grading"), 4),
        "training_s": round(step - mean("sampling") - mean("grading"), 3),
        "completion_tokens": round(mean("tokens"), 1),
        "rollout_tokens_per_s": round(mean("tokens") / max(mean("sampling"), 1e-9), 1),
        "steps_per_hour": round(3600 / step, 2),
        "gpu_peak_gib": None if gpu_peak_gib() is None else round(gpu_peak_gib(), 2),
        "gpu_reserved_gib": gpu_reserved_peak_gib(),
        "host_peak_gib": round(host_peak_gib(), 2),
        "steps": [round(p["step"], 3) for p in measured],
    }


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    from bench.dpo import _wrap  # the same random LoRA model, wrapped, and the engine's Adam
    from rp_service.graders import Sample, build_grader
    from rp_service.graders.spec import StringCheckGrader
    from rp_service.schemas import GrpoSection
    from rp_service.worker.generation import make_sampler
    from rp_service.worker.objectives import grpo
    from rp_service.worker.objectives.grpo_job import (
        _sequences,
        step_generator,
        train_on_rollouts,
    )
    from rp_service.worker.sampling import top_p_draw
    from rp_service.worker.streamed_generation import StreamedRolloutSampler

    progress(f"engine: building {args.model} (random weights) and wrapping it")
    rp, opt = _wrap(args, nf4=args.nf4)
    model = rp.rp_unwrap()[1]  # the HF model: the sampler copies its modules
    rows = args.prompts * args.group
    if args.sampler == "eager":
        os.environ["RP_GRAPH_ROLLOUTS"] = "0"
    if args.merged_adapters:
        os.environ["RP_MERGED_ROLLOUTS"] = "1"
    sampler = make_sampler(
        model,
        rows=rows,
        tokens=args.seq_len,
        streamed_only=args.sampler == "streamed",
        prompt_width=args.prompt_len,
    )
    progress(
        f"engine: wrapped; sampler {type(sampler).__name__}"
        + (" (decode step replayed)" if getattr(sampler, "graphs", False) else "")
    )
    if sampler is None:
        return {"run": "engine", "error": "neither the model nor its streamed layers fit"}
    streamed = isinstance(sampler, StreamedRolloutSampler)
    uploaded = 0.0
    grader = build_grader(
        StringCheckGrader(
            type="string_check",
            name="has_t1",
            input="{{sample.output_text}}",
            reference=_REWARD_TOKEN,
            operation="like",
        ),
        allow_python=False,
        workdir=Path("/tmp"),
    )
    prompts = [p for p in prompt_ids(args, model.config.vocab_size) for _ in range(args.group)]
    options = GrpoSection(group_size=args.group, max_completion_tokens=args.completion_len)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    phases: list[dict[str, float]] = []
    for step in range(1, args.warmup + args.steps + 1):
        if step == args.warmup + 1 and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        rp.synchronize()  # the worker's needs_sync_before_step
        t0 = time.perf_counter()
        before = sampler.uploaded_bytes if streamed else 0
        sampler.refresh()
        draw = top_p_draw(temperature=1.0, top_p=1.0, generator=step_generator(0, step))
        samples = sampler.complete(
            prompts,
            draw=draw,
            max_new_tokens=args.completion_len,
            stop=set(),
            max_positions=1 << 30,
            pad_id=0,
        )
        sampler.step_done()
        t1 = time.perf_counter()
        if streamed and step > args.warmup:
            uploaded += sampler.uploaded_bytes - before
        graded = grader.grade([Sample(output_text=_text(s.ids)) for s in samples], [{}] * rows)
        t2 = time.perf_counter()
        rewards = torch.tensor(graded.scores, dtype=torch.float64)
        advantages = grpo.group_advantages(rewards, args.group)
        ids, targets = _sequences(prompts, samples, pad_id=0)
        values = train_on_rollouts(
            rp, ids, targets, advantages, ref=None, old=None, options=options
        )
        rp.step(step_fn, is_async=True)
        float(values[0])  # the step's host sync
        t3 = time.perf_counter()
        tokens = sum(len(s.ids) for s in samples)
        phases.append({"step": t3 - t0, "sampling": t1 - t0, "grading": t2 - t1, "tokens": tokens})
        # whether the replayed decode step survived its check, and what it cost so far
        graphs = ""
        if not streamed:
            counted = ", ".join(f"{k} {v:.3g}" for k, v in sampler.graph_counters.items())
            graphs = f"; graphs {'on' if sampler.graphs else 'off'}" + (
                f": {counted}" if counted else ""
            )
        progress(
            f"engine: step {step}: {t3 - t0:.1f} s (sampling {t1 - t0:.1f} s, "
            f"grading {t2 - t1:.2f} s, {tokens} completion tokens{graphs})"
        )
    rp.synchronize()
    out = _summary(args, "engine", phases)
    if streamed:
        out["sampler_placement"] = "packed" if sampler.packed_resident else "streamed"
    else:
        out["sampler_placement"] = "resident" if sampler.keep else "per_step"
        out["graph_decoding"] = sampler.graphs  # False also after a fallback
        out["merged_adapters"] = bool(sampler._merges)
        # every step's decoders: captures (their seconds), replays, compactions
        out["graph_counters"] = {k: round(v, 3) for k, v in sampler.graph_counters.items()}
    out["nf4"] = args.nf4
    if streamed:
        measured = max(args.steps, 1)
        out["sampler_device_gib"] = round(sampler.device_bytes / 2**30, 4)
        out["uploaded_gib"] = round(uploaded / measured / 2**30, 4)
        out["upload_gb_per_s"] = round(uploaded / measured / 1e9 / max(out["sampling_s"], 1e-9), 3)
    grader.close()
    return out


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import datasets
        import peft
        import trl
    except ImportError as exc:
        return {"run": "trl", "error": f"not installed here: {exc}"}
    from transformers import TrainerCallback

    progress(f"trl: building {args.model} (random weights) on the GPU")
    model = build_model(args, nf4=False).to(_device())
    tokenizer = word_tokenizer(model.config.vocab_size)
    model.config.pad_token_id = model.config.eos_token_id = 0
    # build_model's config turns the KV cache off (the engine's training needs none), and
    # transformers' generate takes that setting: TRL's rollouts then ran a full forward over
    # every row's whole sequence at each token (session 25: its 8B step did not end in
    # 530 s). A checkpoint's own config keeps the cache on: so does this baseline.
    model.config.use_cache = True
    model.generation_config.use_cache = True
    rows = args.prompts * args.group
    texts = [_text(p) for p in prompt_ids(args, model.config.vocab_size)]
    data = datasets.Dataset.from_list([{"prompt": t} for t in texts] * (args.warmup + args.steps))
    phases: list[dict[str, float]] = []

    def reward(completions: list[str], **_: Any) -> list[float]:
        return [float(_REWARD_TOKEN in c.split()) for c in completions]

    class Timed(trl.GRPOTrainer):  # type: ignore[misc]
        """Times the generation (with scoring) of each step's rollouts."""

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            _sync()
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            _sync()
            phases[-1]["sampling"] += time.perf_counter() - start
            phases[-1]["tokens"] += float(out["completion_mask"].sum())
            # session 25: TRL's first 8B step did not end in 530 s and said nothing of
            # where it was; this line tells the rollouts from the training
            progress(
                f"trl: rollouts of step {len(phases)}: {time.perf_counter() - start:.1f} s, "
                f"{int(out['completion_mask'].sum())} completion tokens"
            )
            return out

    class Steps(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            if len(phases) == args.warmup and torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            phases.append({"start": time.perf_counter(), "sampling": 0.0, "tokens": 0.0})

        def on_step_end(self, *a: Any, **k: Any) -> None:
            _sync()
            phases[-1]["step"] = time.perf_counter() - phases[-1]["start"]
            progress(
                f"trl: step {len(phases)}: {phases[-1]['step']:.1f} s "
                f"(sampling {phases[-1]['sampling']:.1f} s)"
            )

    config = trl.GRPOConfig(
        output_dir="/tmp/bench-grpo-trl",
        per_device_train_batch_size=args.trl_micro,
        gradient_accumulation_steps=rows // args.trl_micro,
        num_generations=args.group,
        max_completion_length=args.completion_len,
        temperature=1.0,
        learning_rate=1e-6,
        max_steps=args.warmup + args.steps,
        bf16=torch.cuda.is_available(),
        gradient_checkpointing=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_vllm=False,
        seed=0,
    )
    trainer = Timed(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(
            r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=_TARGETS
        ),
        callbacks=[Steps()],
    )
    trainer.train()
    for p in phases:
        p["grading"] = 0.0  # inside TRL's scoring, counted as sampling (a string check)
    out = _summary(args, "trl", phases)
    out["trl"] = trl.__version__
    return out


def _child(args: argparse.Namespace, run: str, argv: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--run", run]
    # The child's stderr (its progress lines, a traceback) goes straight to ours: a run cut
    # short by a device call's time limit still shows how far it got (session 24: an 8B
    # engine run printed nothing in 280 s).
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"run": run, "error": f"exit {proc.returncode} (its stderr is above)"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.run is not None:  # a child: one run, one line
        # the replayed decode step's check (its distance from the eager step) on stderr
        logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
        logging.getLogger("rp_service.worker.graph_decode").setLevel(logging.INFO)
        try:
            result = run_engine(args) if args.run == "engine" else run_trl(args)
        except torch.OutOfMemoryError as exc:
            result = {"run": args.run, "error": f"out of memory: {str(exc)[:200]}"}
        print(json.dumps(result), flush=True)
        return [result]
    common = {
        "bench": "grpo",
        "model": args.model,
        "prompts": args.prompts,
        "group": args.group,
        "prompt_len": args.prompt_len,
        "completion_len": args.completion_len,
        "lora_rank": args.lora_rank,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    results = []
    for run in [r for r in args.runs.split(",") if r]:
        result = {**common, **_child(args, run, argv)}
        print(json.dumps(result), flush=True)
        results.append(result)
    done = {r["run"]: r for r in results if "step_s" in r}
    if {"engine", "trl"} <= done.keys():
        summary = {
            **common,
            "run": "summary",
            "steps_per_hour_ratio": round(
                done["engine"]["steps_per_hour"] / done["trl"]["steps_per_hour"], 3
            ),
            "rollout_tokens_per_s_ratio": round(
                done["engine"]["rollout_tokens_per_s"] / done["trl"]["rollout_tokens_per_s"], 3
            ),
        }
        print(json.dumps(summary), flush=True)
        results.append(summary)
    return results


if __name__ == "__main__":
    main()
