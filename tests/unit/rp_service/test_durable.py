"""Durable writes (rp_service.durable): the order of fsyncs and renames, and a writer killed
with SIGKILL mid-way leaves the old complete content or the new, never a part."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rp_service import durable

_SIZE = 1 << 20  # one version of the content: big enough that a kill can land mid-write

# The writer: writes versions 1, 2, ... of `target` (a file, or a folder of two files),
# each version's bytes all equal to its number. With "pause" it stops for good (until
# killed) right before the rename of its first version, after the data is written.
_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from rp_service import durable

    target, kind, first, pause = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    size = int(sys.argv[5])
    if pause == "pause":
        def replace(src, dst):
            print("renaming", flush=True)
            time.sleep(3600)
        os.replace = replace
        durable._exchange = lambda a, b: replace(a, b)
    print("ready", flush=True)
    version = first
    while True:
        data = bytes([version % 251 + 1]) * size
        if kind == "file":
            durable.write_bytes(target, data)
        else:
            with durable.replacing(target, directory=True) as tmp:
                (tmp / "a.bin").write_bytes(data)
                (tmp / "b.bin").write_bytes(data)
        version += 1
    """
)


def _start(target: Path, kind: str, *, first: int, pause: bool) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    mode = "pause" if pause else "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(target), kind, str(first), mode, str(_SIZE)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert _line(proc) == "ready"
    return proc


def _line(proc: subprocess.Popen[str], *, timeout_s: float = 20.0) -> str:
    """The writer's next line; fails (and kills it) when none comes in time."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        _kill(proc)
        pytest.fail(f"the writer said nothing in {timeout_s} s")
    return proc.stdout.readline().strip()


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL


def _version_of(path: Path) -> int:
    """The one version `path` holds whole; fails on a mix or a short file."""
    data = path.read_bytes()
    assert len(data) == _SIZE, f"{path}: {len(data)} bytes, a partial write"
    assert data == bytes([data[0]]) * _SIZE, f"{path}: bytes of two versions"
    return data[0]


def _content(target: Path, kind: str) -> int | None:
    if not target.exists():
        return None
    if kind == "file":
        return _version_of(target)
    versions = {_version_of(target / "a.bin"), _version_of(target / "b.bin")}
    assert len(versions) == 1, f"{target}: files of two versions {versions}"
    assert sorted(p.name for p in target.iterdir()) == ["a.bin", "b.bin"]
    return versions.pop()


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_writer_killed_between_write_and_rename_leaves_the_old_content(
    tmp_path: Path, kind: str
) -> None:
    target = tmp_path / "target"
    proc = _start(target, kind, first=7, pause=True)
    assert _line(proc) == "renaming"  # written whole, not yet renamed
    _kill(proc)
    assert _content(target, kind) is None  # the first write never happened under the name
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(durable.TMP_PREFIX)]
    assert len(leftovers) == 1  # the new content, under its temporary name only

    # Now with an old version in place: still the old one after the kill.
    for p in leftovers:
        durable._remove(p)
    old = 3
    if kind == "file":
        durable.write_bytes(target, bytes([old + 1]) * _SIZE)
    else:
        with durable.replacing(target, directory=True) as tmp:
            (tmp / "a.bin").write_bytes(bytes([old + 1]) * _SIZE)
            (tmp / "b.bin").write_bytes(bytes([old + 1]) * _SIZE)
    proc = _start(target, kind, first=9, pause=True)
    assert _line(proc) == "renaming"
    _kill(proc)
    assert _content(target, kind) == old + 1


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_writer_killed_at_random_times_leaves_a_whole_version(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "target"
    rng = random.Random(42)
    seen: list[int | None] = []
    for round_ in range(5):
        proc = _start(target, kind, first=1 + 40 * round_, pause=False)
        time.sleep(rng.uniform(0.02, 0.25))
        _kill(proc)
        seen.append(_content(target, kind))
        # Nothing but the real name and temporaries (which no reader takes for it).
        for path in tmp_path.iterdir():
            assert path.name == "target" or path.name.startswith(durable.TMP_PREFIX), path
    assert any(v is not None for v in seen), "no write ever finished: the test proved nothing"


def test_the_order_is_write_fsync_rename_fsync_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, str]] = []
    fsync_path, replace = durable.fsync_path, os.replace

    def record_fsync(path: Path) -> None:
        calls.append(("fsync", Path(path).name))
        fsync_path(path)

    def record_replace(src: os.PathLike[str], dst: os.PathLike[str]) -> None:
        calls.append(("rename", Path(dst).name))
        replace(src, dst)

    monkeypatch.setattr(durable, "fsync_path", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    target = tmp_path / "spec.json"
    durable.write_bytes(target, b"{}")
    tmp_name = durable.tmp_path(target).name
    assert calls == [("fsync", tmp_name), ("rename", "spec.json"), ("fsync", tmp_path.name)]
    assert target.read_bytes() == b"{}"


def test_a_failing_block_leaves_the_old_content_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with durable.replacing(target, directory=True) as tmp:
        (tmp / "model.bin").write_bytes(b"old")
    with (
        pytest.raises(OSError, match="disk full"),
        durable.replacing(target, directory=True) as tmp,
    ):
        (tmp / "model.bin").write_bytes(b"new, half")
        raise OSError(28, "disk full")
    assert (target / "model.bin").read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_folder_replaces_a_folder(tmp_path: Path) -> None:
    target = tmp_path / "step-00000010"
    for content in (b"first", b"second"):
        with durable.replacing(target, directory=True) as tmp:
            (tmp / "state.json").write_bytes(content)
    assert (target / "state.json").read_bytes() == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000010"]


def test_a_token_file_is_private_from_its_first_byte(tmp_path: Path) -> None:
    target = tmp_path / "token"
    durable.write_bytes(target, b"secret\n", mode=0o600)
    assert target.stat().st_mode & 0o777 == 0o600
