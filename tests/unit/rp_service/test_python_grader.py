"""The python grader's sandbox (rp_service/graders/python_grader.py): each layer refuses what
it should, every failure scores 0 and is counted, and the grader keeps grading after it."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rp_service.graders import GraderConfigError, PythonGrader, Sample, build_grader
from rp_service.graders.python_grader import PythonSandboxGrader, SandboxLimits

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux's")

# One source, one behaviour per sample text: a grader process serves them all in turn.
SOURCE = """
import os, socket, subprocess

def grade(sample, item):
    what = sample["output_text"]
    if what == "connect":
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(1)
        s.connect(("127.0.0.1", item["port"]))
        return 1.0
    if what == "write-outside":
        with open(item["path"], "w") as f:
            f.write("escaped")
        return 1.0
    if what == "write-inside":
        with open("notes.txt", "w") as f:
            f.write("fine")
        return 0.5
    if what == "spawn":
        started = []
        for _ in range(item["tries"]):  # bounded: stops at the limit or after `tries`
            try:
                started.append(subprocess.Popen(["sleep", "3"]))
            except OSError:
                break
        for proc in started:
            proc.kill()
            proc.wait()
        return float(len(started))
    if what == "ctypes":
        import ctypes
        return float(ctypes.CDLL(None).getpid())
    if what == "signal-parent":
        os.kill(os.getppid(), 0)
        return 1.0
    if what == "loop":
        while True:
            pass
    if what == "raise":
        raise RuntimeError("boom")
    if what == "nan":
        return float("nan")
    if what == "text":
        return "1.0"
    if what == "json":
        return float(sample["output_json"]["n"])
    return 1.0 if what == item.get("answer") else 0.0
"""


def _grader(tmp_path: Path, **limits: object) -> PythonSandboxGrader:
    spec = PythonGrader(type="python", name="py", source=SOURCE)
    opts = {"sample_timeout_s": 1.0} | limits
    return PythonSandboxGrader(spec, workdir=tmp_path / "sandbox", limits=SandboxLimits(**opts))


@pytest.fixture
def grader(tmp_path: Path) -> Iterator[PythonSandboxGrader]:
    built = _grader(tmp_path)
    yield built
    built.close()


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP port listening on this machine's loopback (the daemon's namespace)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


def test_scores_come_back_per_sample(grader: PythonSandboxGrader) -> None:
    samples = [Sample("a"), Sample("b"), Sample("json", output_json={"n": 3})]
    items = [{"answer": "a"}, {"answer": "a"}, {}]
    result = grader.grade(samples, items)
    assert result.scores == [1.0, 0.0, 3.0]
    assert result.by_grader == {"py": [1.0, 0.0, 3.0]}
    assert result.errors == 0


def test_bad_returns_and_exceptions_score_zero_counted(grader: PythonSandboxGrader) -> None:
    texts = ["raise", "nan", "text", "a"]
    result = grader.grade([Sample(t) for t in texts], [{"answer": "a"}] * 4)
    assert result.scores == [0.0, 0.0, 0.0, 1.0]
    assert result.failed == [True, True, True, False]
    assert "RuntimeError: boom" in (result.error_details[0] or "")


def test_network_is_refused(grader: PythonSandboxGrader, listener: int) -> None:
    result = grader.grade([Sample("connect"), Sample("a")], [{"port": listener}, {"answer": "a"}])
    assert result.scores == [0.0, 1.0]
    assert result.errors == 1
    assert "socket" in (result.error_details[0] or "")


def test_the_network_namespace_alone_refuses_loopback(tmp_path: Path, listener: int) -> None:
    grader = _grader(tmp_path, audit_network=False)
    try:
        result = grader.grade([Sample("connect")], [{"port": listener}])
        if os.geteuid() == 0:  # root can always make a namespace on Linux
            assert grader.isolation["network"] == "namespace"
        if grader.isolation["network"] == "namespace":
            assert result.scores == [0.0]
            assert "unreachable" in (result.error_details[0] or "").lower()
    finally:
        grader.close()


def test_writes_outside_the_directory_are_refused(
    grader: PythonSandboxGrader, tmp_path: Path
) -> None:
    outside = tmp_path / "escaped.txt"
    result = grader.grade(
        [Sample("write-outside"), Sample("write-inside")], [{"path": str(outside)}, {}]
    )
    assert result.scores == [0.0, 0.5]
    assert not outside.exists()
    assert (tmp_path / "sandbox" / "notes.txt").read_text() == "fine"


def test_foreign_calls_and_signals_to_other_processes_are_refused(
    grader: PythonSandboxGrader,
) -> None:
    result = grader.grade(
        [Sample("ctypes"), Sample("signal-parent"), Sample("a")], [{"answer": "a"}] * 3
    )
    assert result.scores == [0.0, 0.0, 1.0]
    assert "ctypes" in (result.error_details[0] or "")
    assert "os.kill" in (result.error_details[1] or "")


def test_the_mounts_alone_refuse_writes_outside(tmp_path: Path) -> None:
    grader = _grader(tmp_path, audit_writes=False)
    outside = tmp_path / "escaped.txt"
    try:
        result = grader.grade(
            [Sample("write-outside"), Sample("write-inside")], [{"path": str(outside)}, {}]
        )
        if os.geteuid() == 0:  # root can always make a mount namespace on Linux
            assert grader.isolation["filesystem"] == "read-only"
        if grader.isolation["filesystem"] == "read-only":
            assert result.scores == [0.0, 0.5]
            assert "Read-only file system" in (result.error_details[0] or "")
            assert not outside.exists()
    finally:
        grader.close()


def test_only_a_sandbox_run_as_nobody_starts_processes(grader: PythonSandboxGrader) -> None:
    result = grader.grade([Sample("spawn")], [{"tries": 10}])
    budget = grader.isolation["max_processes"]
    assert budget == (4 if grader.isolation["user"] == "nobody" else 0)
    assert result.scores == [float(budget)]


def test_processes_stop_at_the_limit(tmp_path: Path) -> None:
    grader = _grader(tmp_path, max_processes=3, unconfined_processes=True)
    try:
        result = grader.grade([Sample("spawn")], [{"tries": 10}])
        assert result.scores == [3.0]  # 3 started, the 4th refused, the loop stopped there
        again = grader.grade([Sample("spawn"), Sample("a")], [{"tries": 10}, {"answer": "a"}])
        assert again.scores == [0.0, 1.0]  # the budget is the process's, spent
    finally:
        grader.close()


def test_an_infinite_loop_times_out_and_grading_goes_on(tmp_path: Path) -> None:
    grader = _grader(tmp_path, sample_timeout_s=0.5)
    try:
        started = time.monotonic()
        result = grader.grade([Sample("loop"), Sample("a")], [{}, {"answer": "a"}])
        elapsed_s = time.monotonic() - started
        assert result.scores == [0.0, 1.0]
        assert result.errors == 1
        assert "0.5 s" in (result.error_details[0] or "")
        assert elapsed_s < 2.5
    finally:
        grader.close()


def test_the_batch_timeout_fails_the_rest_without_running_them(tmp_path: Path) -> None:
    grader = _grader(tmp_path, sample_timeout_s=0.4, batch_timeout_s=0.6)
    try:
        result = grader.grade(
            [Sample("loop"), Sample("loop"), Sample("a")], [{}, {}, {"answer": "a"}]
        )
        assert result.scores == [0.0, 0.0, 0.0]
        assert result.errors == 3
        assert "batch" in (result.error_details[2] or "")
    finally:
        grader.close()


def test_limits_and_user_are_applied(tmp_path: Path) -> None:
    source = (
        "import os, resource\n"
        "def grade(sample, item):\n"
        "    soft, hard = resource.getrlimit(getattr(resource, sample['output_text']))\n"
        "    return float(hard)\n"
    )
    grader = PythonSandboxGrader(
        PythonGrader(type="python", name="py", source=source),
        workdir=tmp_path / "sandbox",
        limits=SandboxLimits(mem_bytes=1 << 30, cpu_s=77, file_bytes=1 << 20),
    )
    try:
        names = ["RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE"]
        result = grader.grade([Sample(n) for n in names], [{}] * 3)
        assert result.scores == [float(1 << 30), 77.0, float(1 << 20)]
        if os.geteuid() == 0:  # as nobody, or as root without its capabilities
            assert grader.isolation["user"] in {"nobody", "root, no capabilities"}
    finally:
        grader.close()


def test_a_source_that_fails_to_load_fails_each_sample(tmp_path: Path) -> None:
    spec = PythonGrader(
        type="python", name="py", source="import no_such_module\ndef grade(s, i):\n    return 1\n"
    )
    grader = PythonSandboxGrader(spec, workdir=tmp_path / "sandbox")
    try:
        result = grader.grade([Sample("a"), Sample("b")], [{}, {}])
        assert (result.scores, result.errors) == ([0.0, 0.0], 2)
        assert "no_such_module" in (result.error_details[0] or "")
    finally:
        grader.close()


@pytest.mark.parametrize(
    ("source", "message"),
    [("def grade(:\n", "does not parse"), ("def other(sample, item):\n    return 1\n", "grade")],
)
def test_sources_that_cannot_run_are_refused_at_build(
    source: str, message: str, tmp_path: Path
) -> None:
    spec = PythonGrader(type="python", name="py", source=source)
    with pytest.raises(GraderConfigError, match=message) as caught:
        build_grader(spec, allow_python=True, workdir=tmp_path)
    assert caught.value.field == "grader.source"


def test_close_ends_the_process_and_a_later_grade_starts_another(
    grader: PythonSandboxGrader,
) -> None:
    assert grader.grade([Sample("a")], [{"answer": "a"}]).scores == [1.0]
    pid = grader._proc.pid if grader._proc else None
    grader.close()
    assert pid is not None and not Path(f"/proc/{pid}").exists()
    assert grader.grade([Sample("a")], [{"answer": "a"}]).scores == [1.0]
