"""The seeds' module paths (`roundpipe.X` is `engine.X`) give the documented names, where the
engine keeps a helper with its caller (profile -> timer, utils -> call_site and memory)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

SEED_NAMES = {
    "profile": ["PROFILER_TYPE", "annotate"],
    "utils": ["get_call_location", "get_model_active_size", "get_model_size"],
    "timer": ["IterTimer", "ModelTimer"],
    "run_config": ["RoundPipeRunConfig", "FullRoundPipeRunConfig"],
    "scheduler": ["ModelExecutePlan", "ModelTracker"],
    "batch": ["Batch", "RoundPipePackedData", "AvgReducer", "avg_reducer", "guess_split_spec"],
    "optim.optim_builder": [
        "loaded_optim_functions",
        "get_cpu_flags_hash",
        "get_optim_function",
        "load_optim_function",
    ],
    "threads": [
        "AnnotatedEvent",
        "AnnotatedSemaphore",
        "RoundPipeThread",
        "roundpipe_threads",
        "thread_exception_print_lock",
        "KeyboardInterruptRoundPipeThreads",
        "dump_all_active_threads",
        "is_threading_internal",
        "print_trimmed_traceback",
    ],
    "wrapper": ["wrap_model_to_roundpipe", "wrap_model_recursive"],
    "roundpipe": ["RoundPipe", "AutoRoundPipe"],
}


@pytest.mark.parametrize("module", sorted(SEED_NAMES))
def test_the_seed_module_has_its_names(module: str) -> None:
    mod = importlib.import_module(f"engine.{module}")
    missing = [name for name in SEED_NAMES[module] if not hasattr(mod, name)]
    assert not missing, f"engine.{module} lacks {missing}"


def test_the_aliases_are_the_engines_own() -> None:
    from engine import call_site, memory, profile, timer, utils

    assert profile.annotate is timer.annotate
    assert profile.PROFILER_TYPE == timer.PROFILER_TYPE
    assert utils.get_call_location is call_site.get_call_location
    assert utils.get_model_size is memory.get_model_size
    with profile.annotate("a range"):  # a no-op context without a profiler
        pass


def test_model_sizes_count_bytes() -> None:
    from engine.utils import get_model_active_size, get_model_size

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))  # 20 + 8 params, 2 + 1 buffers
    model[1].requires_grad_(False)
    params = (16 + 4 + 4 + 4) * 4
    buffers = (4 + 4) * 4 + torch.tensor(0).element_size()
    assert get_model_size(model) == params + buffers
    assert get_model_active_size(model) == (16 + 4) * 4
    assert get_model_size(model, recurse=False) == 0
