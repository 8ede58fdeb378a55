"""engine.threads' debugging aids from the seeds: the stacks of the RoundPipe threads at
work, and a Ctrl-C while RoundPipe waits that says where they were."""

from __future__ import annotations

import sys
import threading

import pytest

from engine import threads
from engine.optim import optim_builder
from engine.threads import (
    KeyboardInterruptRoundPipeThreads,
    RoundPipeThread,
    dump_all_active_threads,
    interruptible_wait,
    is_threading_internal,
    print_trimmed_traceback,
    working,
)


def _parked_in_a_job(release: threading.Event, started: threading.Event) -> None:
    with working():
        started.set()
        release.wait(10)


def test_the_dump_shows_threads_at_work_without_threading_frames(
    capsys: pytest.CaptureFixture[str],
) -> None:
    release, started = threading.Event(), threading.Event()
    busy = RoundPipeThread(lambda: _parked_in_a_job(release, started), name="rp-test-busy")
    idle = RoundPipeThread(lambda: release.wait(10), name="rp-test-idle")
    busy.start()
    idle.start()
    try:
        assert started.wait(5)
        assert busy.is_active and not idle.is_active
        dump_all_active_threads()
    finally:
        release.set()
        busy.join(5)
        idle.join(5)
    err = capsys.readouterr().err
    assert "RoundPipe thread rp-test-busy (at work):" in err
    assert "_parked_in_a_job" in err
    assert "rp-test-idle" not in err
    assert "threading.py" not in err
    assert not busy.is_active  # working() ends with the job


def test_a_frame_is_internal_by_its_file() -> None:
    frame = sys._getframe()
    assert not is_threading_internal(frame)
    seen: list[bool] = []
    t = threading.Thread(target=lambda: seen.append(is_threading_internal(sys._getframe(1))))
    t.start()
    t.join()
    assert seen == [True]  # the caller of a thread's target is Thread.run


def test_print_trimmed_traceback_of_no_frame(capsys: pytest.CaptureFixture[str]) -> None:
    print_trimmed_traceback(None)
    assert "no frame" in capsys.readouterr().err


def test_ctrl_c_while_waiting_dumps_and_raises_its_own_interrupt(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterruptRoundPipeThreads, match="printed above"):
        interruptible_wait(interrupted)
    assert interruptible_wait(lambda: 7) == 7
    assert issubclass(KeyboardInterruptRoundPipeThreads, KeyboardInterrupt)
    assert threads.thread_exception_print_lock.acquire(blocking=False)  # released again
    threads.thread_exception_print_lock.release()


def test_optim_builder_hands_out_the_c_functions_by_name() -> None:
    pytest.importorskip("cffi")
    key = optim_builder.get_cpu_flags_hash()
    assert len(key) == 16 and key == optim_builder.get_cpu_flags_hash()
    version = optim_builder.get_optim_function("rp_adam_abi_version")
    assert version() >= 1
    assert optim_builder.loaded_optim_functions["rp_adam_abi_version"] is version
    assert optim_builder.get_optim_function("rp_adam_abi_version") is version
    with pytest.raises(Exception, match="no C optimizer function 'adam'.*rp_adam_step"):
        optim_builder.load_optim_function("adam")
