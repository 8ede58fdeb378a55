"""The serving process: one base model in memory, its LoRA adapters, one generation at a time.

`python -m rp_service.serving BASE_JSON --device cpu|cuda:0`. The daemon
(rp_service/serving/manager.py) writes one JSON request per line on stdin and reads JSON
lines back on stdout (the process's real stdout: fd 1 is pointed at stderr, so a library
that prints cannot break the protocol):

    -> {"op": "generate", "id": "r1", "messages": [...], "tokenizer": DIR, "adapter": DIR|null,
        "max_tokens": N|null, "temperature": T, "top_p": P, "seed": S|null, "stop": [...]}
    <- {"id": "r1", "type": "start", "prompt_tokens": N}
    <- {"id": "r1", "type": "delta", "text": "..."}                      (0 or more)
    <- {"id": "r1", "type": "done", "finish_reason": "stop"|"length", "completion_tokens": N,
        "prompt_tokens": N}
    <- {"id": "r1", "type": "error", "status": 400, "code": "...", "message": "..."}
    -> {"op": "cancel", "id": "r1"}            stop that generation at its next token (or
                                               drop it unanswered if it has not started)
    -> {"op": "unload", "adapter": DIR}        forget that adapter (its job was deleted)

It writes `{"type": "ready", "load_s": s}` once the base is loaded, and exits at the end of
stdin (the daemon stopped it, or died: the process never outlives its daemon).

Text comes from transformers' `generate` through `TextIteratorStreamer` (whole words, as
the streamer releases them). Adapters load on first use (peft's `load_adapter`) and are
switched per request (`set_adapter`); a request for the base runs with the adapters
disabled. Stop sequences are cut here, as OpenAI cuts them: not part of the answer.

On a GPU, decoding is compiled: with a static KV cache (`cache_implementation="static"`)
`generate` compiles its one-token step (CUDA graphs): eager decoding pays Python and a
kernel launch per layer for every token, several times the compiled step (the figures are
in bench/RESULTS.md). Compiling takes a while for a large model, so a model state (the
base, or an adapter) is answered eagerly the first time, and the compile runs right after that
answer, before the next request is taken (`_warm_up`): a cold request's first token never
waits for it; a request that arrives during it waits. The cache is sized in powers of two
from 2,048 tokens (`static_cache_tokens`), so later requests reuse the compiled step; a
longer one compiles its size once. All generation runs on one thread: CUDA graphs are
kept per thread. `RP_SERVE_COMPILE=0` keeps eager decoding.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import IO, Any

from rp_service.serving.models import BaseModel
from rp_service.serving.stops import StopMatcher

__all__ = ["main"]

log = logging.getLogger(__name__)

_ADAPTERS_KEPT = 8  # adapters loaded at once; the least recently used one goes first
_CHATML_END = "<|im_end|>"  # ends a turn in ChatML, the built-in tokenizer's template
_MIN_CACHE_TOKENS = 2048  # the smallest static KV cache (see the module doc)


def static_cache_tokens(needed: int, positions: int) -> int:
    """The static KV cache's length for `needed` tokens: the next power of two from
    _MIN_CACHE_TOKENS, at most the model's `positions` (few sizes: few compiles)."""
    size = _MIN_CACHE_TOKENS
    while size < needed:
        size *= 2
    return max(needed, min(size, positions))


def _static_cache(needed: int, positions: int) -> dict[str, Any]:
    """`generate` options for the static KV cache (which makes it compile decoding)."""
    return {
        "cache_implementation": "static",
        "max_cache_len": static_cache_tokens(needed, positions),
    }


def _compile_decoding(device: str) -> bool:
    return device != "cpu" and os.environ.get("RP_SERVE_COMPILE", "1") != "0"


class RequestError(Exception):
    """A request this model cannot answer; `status` is the HTTP status the daemon returns."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


class _Out:
    """The protocol channel: one JSON object per line, writes from any thread."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.lock = threading.Lock()

    def send(self, **message: Any) -> None:
        line = json.dumps(message, separators=(",", ":")) + "\n"
        with self.lock:
            self.stream.write(line)
            self.stream.flush()


def _load_base(base: BaseModel, *, device: str, dtype: Any) -> Any:
    """The base causal LM on `device`, in `dtype`, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if base.path is not None:
        # Straight onto the GPU: no copy of the weights in host memory first.
        place = {} if device == "cpu" else {"device_map": {"": device}}
        model = AutoModelForCausalLM.from_pretrained(
            base.path, dtype=dtype, use_safetensors=True, **place
        )
    else:
        # A LoRA job on a preset: its random initialisation, rebuilt as the worker built it.
        from rp_service.worker.modeling import build_model

        tokenizer = AutoTokenizer.from_pretrained(base.tokenizer)
        model = build_model(
            preset=base.preset,
            config_overrides=dict(base.config),
            path=None,
            dtype="float32",
            vocab_size=len(tokenizer),
            seed=base.seed,
        ).to(dtype)
    model.to(torch.device(device))
    model.eval()
    return model


class _Stop:
    """A `StoppingCriteria`: true once the request is cancelled or a stop sequence matched."""

    def __init__(self, flag: threading.Event) -> None:
        self.flag = flag

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        # on the ids' device: generate ORs it into its own (GPU) done flags
        return torch.full(
            (input_ids.shape[0],), self.flag.is_set(), dtype=torch.bool, device=input_ids.device
        )


class _Folded:
    """The active adapter folded into copies of the weights it adapts, so decoding costs
    what the base costs (no LoRA matmuls per projection per token). The base weights are
    kept aside and put back as they were (no merge/unmerge rounding drift in bf16)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.kept: list[tuple[Any, Any]] = []  # (LoRA layer, its base weight)

    def fold(self, model: Any, name: str) -> None:
        import torch
        from peft.tuners.lora import LoraLayer

        if self.name == name:
            return
        self.unfold()
        with torch.no_grad():
            for module in model.modules():
                if not isinstance(module, LoraLayer) or name not in module.lora_A:
                    continue
                linear = module.get_base_layer()
                weight = linear.weight
                delta = module.get_delta_weight(name)  # scaling * B @ A, in the adapter's dtype
                folded = (weight.float() + delta.float()).to(weight.dtype)
                linear.weight = torch.nn.Parameter(folded, requires_grad=False)
                # peft's forward then runs the base layer alone (as after its own merge)
                module.merged_adapters = [name]
                self.kept.append((module, weight))
        self.name = name

    def unfold(self) -> None:
        for module, weight in self.kept:
            module.get_base_layer().weight = weight
            module.merged_adapters = []
        self.kept.clear()
        self.name = None


class Server:
    """Holds the base, its adapters and tokenizers; answers requests one at a time.

    `fold_adapters` (on a GPU): the requested adapter is folded into the weights
    (`_Folded`) until another adapter or the base is asked for; else peft runs it unfolded.
    """

    def __init__(
        self, base: BaseModel, *, device: str, out: _Out, fold_adapters: bool = False
    ) -> None:
        import torch

        self.device = device
        self.dtype = torch.float32 if device == "cpu" else torch.bfloat16
        self.out = out
        self.base = _load_base(base, device=device, dtype=self.dtype)
        self.model: Any = self.base  # a PeftModel once an adapter is loaded
        self.adapters: OrderedDict[str, str] = OrderedDict()  # folder -> peft adapter name
        self.folded = _Folded() if fold_adapters else None
        self.tokenizers: dict[str, Any] = {}
        self.cancelled: dict[str, threading.Event] = {}
        # One generation thread for the process's life: compiled steps' CUDA graphs are
        # kept per thread (a graph captured on one thread cannot replay on another).
        self.generator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rp-generate")
        # adapter (None: the base) -> its decoding step compiled (False: compiling failed)
        self.compiled: dict[str | None, bool] = {}

    # -- models

    def _tokenizer(self, folder: str) -> Any:
        if folder not in self.tokenizers:
            from transformers import AutoTokenizer

            self.tokenizers[folder] = AutoTokenizer.from_pretrained(folder)
        return self.tokenizers[folder]

    def _select(self, adapter: str | None) -> Any:
        """The model to generate with and the context to generate in (adapters off: base)."""
        if adapter is None:
            if self.model is self.base:
                return self.model, nullcontext()
            if self.folded is not None:
                self.folded.unfold()
            return self.model, self.model.disable_adapter()
        name = self.adapters.get(adapter)
        if name is not None and self.folded is not None and self.folded.name == name:
            self.adapters.move_to_end(adapter)
            return self.model, nullcontext()  # folded already (set_adapter would unmerge it)
        if self.folded is not None:
            self.folded.unfold()  # peft must see the base weights to load or switch adapters
        if name is None:
            from peft import PeftModel

            name = f"a{len(self.adapters)}_{abs(hash(adapter)) % 10**8}"
            if self.model is self.base:
                self.model = PeftModel.from_pretrained(self.base, adapter, adapter_name=name)
            else:
                self.model.load_adapter(adapter, adapter_name=name)
            self.model.eval()
            self.adapters[adapter] = name
            if len(self.adapters) > _ADAPTERS_KEPT:
                _, oldest = self.adapters.popitem(last=False)
                self.model.delete_adapter(oldest)
            log.info("adapter %s loaded as %s", adapter, name)
        self.adapters.move_to_end(adapter)
        self.model.set_adapter(name)
        if self.folded is not None:
            self.folded.fold(self.model, name)
        return self.model, nullcontext()

    # -- one request

    def _prompt_ids(self, tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
        if not tokenizer.chat_template:
            raise RequestError(
                "this model's tokenizer has no chat template, so messages cannot be rendered",
                code="no_chat_template",
            )
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template writes the special tokens itself: add none.
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def _stop_ids(self, model: Any, tokenizer: Any) -> list[int]:
        """End-of-text ids: the generation config's, the tokenizer's, and ChatML's turn end."""
        ids: list[int] = []
        configured = getattr(model.generation_config, "eos_token_id", None)
        for value in [configured, tokenizer.eos_token_id]:
            ids.extend(value if isinstance(value, list) else [] if value is None else [value])
        if _CHATML_END in (tokenizer.chat_template or ""):
            end = tokenizer.convert_tokens_to_ids(_CHATML_END)
            if isinstance(end, int) and end != tokenizer.unk_token_id:
                ids.append(end)
        return sorted(set(ids))

    def generate(self, request: dict[str, Any]) -> None:
        import torch
        from transformers import StoppingCriteriaList, TextIteratorStreamer

        rid = request["id"]
        flag = self.cancelled.setdefault(rid, threading.Event())
        tokenizer = self._tokenizer(request["tokenizer"])
        model, context = self._select(request.get("adapter"))
        prompt = self._prompt_ids(tokenizer, request["messages"])
        positions = getattr(model.config, "max_position_embeddings", None) or (1 << 30)
        room = positions - len(prompt)
        if room <= 0:
            raise RequestError(
                f"the messages are {len(prompt)} tokens; this model's context is {positions}",
                code="context_length_exceeded",
            )
        wanted = request.get("max_tokens")
        max_new = room if wanted is None else min(int(wanted), room)
        self.out.send(id=rid, type="start", prompt_tokens=len(prompt))
        stop_ids = self._stop_ids(model, tokenizer)
        temperature = request.get("temperature")
        temperature = 1.0 if temperature is None else float(temperature)
        sample = temperature > 0
        options: dict[str, Any] = {"do_sample": sample}
        if sample:
            top_p = request.get("top_p")
            # OpenAI samples from the whole distribution: no top-k unless the model says so.
            options.update(temperature=temperature, top_p=1.0 if top_p is None else top_p, top_k=0)
            if request.get("seed") is not None:
                torch.manual_seed(int(request["seed"]))
        adapter = request.get("adapter")
        if _compile_decoding(self.device) and self.compiled.get(adapter):
            options.update(_static_cache(len(prompt) + max_new, positions))
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        input_ids = torch.tensor([prompt], device=self.device)
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                with torch.inference_mode(), context:
                    result["ids"] = model.generate(
                        input_ids=input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        max_new_tokens=max_new,
                        eos_token_id=stop_ids or None,
                        pad_token_id=tokenizer.pad_token_id
                        if tokenizer.pad_token_id is not None
                        else (stop_ids[0] if stop_ids else 0),
                        use_cache=True,
                        streamer=streamer,
                        stopping_criteria=StoppingCriteriaList([_Stop(flag)]),
                        **options,
                    )
            except BaseException as exc:  # handed to the request's thread below
                result["error"] = exc
                streamer.end()

        finished = self.generator.submit(run)
        stops = [s for s in request.get("stop") or [] if s]
        matched = self._relay(rid, streamer, stops, flag)
        finished.result()
        if "error" in result:
            raise result["error"]
        new = result["ids"][0, len(prompt) :].tolist()
        if matched or (new and new[-1] in stop_ids):
            reason = "stop"
        elif len(new) >= max_new:
            reason = "length"
        else:
            reason = "stop"  # cancelled
        self.out.send(
            id=rid,
            type="done",
            finish_reason=reason,
            completion_tokens=len(new),
            prompt_tokens=len(prompt),
        )

    def _warm_up(self, adapter: str | None) -> None:
        """Compile the decoding step for `adapter` (None: the base) if it is not yet: a
        two-token generate with the static cache, on the generation thread."""
        if not _compile_decoding(self.device) or adapter in self.compiled:
            return
        import torch

        positions = getattr(self.base.config, "max_position_embeddings", None) or (1 << 30)

        def run() -> None:
            model, context = self._select(adapter)
            ids = torch.zeros((1, 8), dtype=torch.long, device=self.device)
            started = time.perf_counter()
            with torch.inference_mode(), context:
                model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=2,
                    min_new_tokens=2,
                    do_sample=False,
                    pad_token_id=0,
                    use_cache=True,
                    **_static_cache(ids.shape[1] + 2, positions),
                )
            seconds = time.perf_counter() - started
            log.info("decoding compiled for %s in %.1f s", adapter or "the base", seconds)

        try:
            self.generator.submit(run).result()
            self.compiled[adapter] = True
        except Exception:  # eager decoding still answers: say why, once per state
            log.exception("compiling the decoding step failed; decoding stays eager")
            self.compiled[adapter] = False

    def _relay(self, rid: str, streamer: Any, stops: list[str], flag: threading.Event) -> bool:
        """Send the streamer's text on, cut at the first stop sequence; True if one matched.

        Text that could be the start of a stop sequence is held back until it is not
        (rp_service/serving/stops.py: linear in the text, whatever the stops' length).
        """
        matcher = StopMatcher(stops)
        matched = False
        for piece in streamer:
            if matched or flag.is_set():
                continue  # drain: generate ends at its next token
            send, matched = matcher.feed(piece)
            if matched:
                flag.set()
            if send:
                self.out.send(id=rid, type="delta", text=send)
        held = matcher.flush()
        if held and not flag.is_set():
            self.out.send(id=rid, type="delta", text=held)
        return matched

    def unload(self, adapter: str) -> None:
        """Forget an adapter (its job was deleted): its weights leave memory now."""
        name = self.adapters.pop(adapter, None)
        self.compiled.pop(adapter, None)
        if name is None:
            return
        if self.folded is not None and self.folded.name == name:
            self.folded.unfold()
        if self.adapters:
            self.model.set_adapter(next(reversed(self.adapters.values())))
            self.model.delete_adapter(name)
        else:  # the last one: the plain base again, with no LoRA layers left in it
            self.model = self.model.unload()
            self.base = self.model
        log.info("adapter %s unloaded (%s)", adapter, name)

    def answer(self, request: dict[str, Any]) -> None:
        rid = request.get("id", "")
        if request.get("op") == "unload":
            self.unload(str(request.get("adapter")))
            return
        if (flag := self.cancelled.get(rid)) is not None and flag.is_set():
            self.cancelled.pop(rid, None)  # its client left while it waited: not generated
            return
        try:
            self.generate(request)
            self._warm_up(request.get("adapter"))  # answered: compile before the next one
        except RequestError as exc:
            self.out.send(
                id=rid, type="error", status=exc.status, code=exc.code, message=exc.message
            )
        except Exception as exc:
            log.exception("request %s failed", rid)
            adapter = request.get("adapter")
            if self.compiled.get(adapter):  # the compiled step failed: decode eagerly from now
                self.compiled[adapter] = False
            self.out.send(
                id=rid,
                type="error",
                status=500,
                code="generation_failed",
                message=f"generation failed: {type(exc).__name__}: {exc}",
            )
        finally:
            self.cancelled.pop(rid, None)


def _read_requests(server: Server, requests: queue.Queue[dict[str, Any] | None]) -> None:
    """stdin -> the request queue; a cancel acts at once; the end of stdin ends the process."""
    for line in sys.stdin:
        try:
            message = json.loads(line)
        except ValueError:
            log.warning("ignored a line that is not JSON: %.80s", line)
            continue
        if message.get("op") == "cancel":
            server.cancelled.setdefault(message.get("id", ""), threading.Event()).set()
        elif message.get("op") in ("generate", "unload"):
            requests.put(message)  # in order: an unload waits for the answer before it
    for flag in list(server.cancelled.values()):
        flag.set()
    requests.put(None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rp_service.serving")
    parser.add_argument("base", help="the BaseModel to load, as JSON")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:N")
    parser.add_argument(
        "--fold-adapters", action="store_true", help="fold the active adapter into the weights"
    )
    args = parser.parse_args(argv)
    # The protocol keeps the real stdout; anything else printed goes to stderr (the log).
    out = _Out(os.fdopen(os.dup(1), "w", encoding="utf-8"))
    os.dup2(2, 1)
    logging.basicConfig(
        level=os.environ.get("RP_LOG_LEVEL", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    started = time.perf_counter()
    base = BaseModel.from_json(args.base)
    try:
        server = Server(base, device=args.device, out=out, fold_adapters=args.fold_adapters)
    except Exception as exc:
        log.exception("loading %s failed", base)
        out.send(type="failed", message=f"loading the model failed: {type(exc).__name__}: {exc}")
        return 1
    load_s = time.perf_counter() - started
    log.info("serving %s on %s (loaded in %.1f s)", base.path or base.preset, args.device, load_s)
    out.send(type="ready", load_s=round(load_s, 3), pid=os.getpid())
    requests: queue.Queue[dict[str, Any] | None] = queue.Queue()
    threading.Thread(
        target=_read_requests, args=(server, requests), name="rp-serve-stdin", daemon=True
    ).start()
    while (request := requests.get()) is not None:
        server.answer(request)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
