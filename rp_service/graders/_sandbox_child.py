"""The sandboxed process of a python grader: isolates itself, loads the source, grades.

Not imported by the daemon: `python_grader.py` reads this file's text and runs it with
`python -I -B -c`, so the child needs nothing but the standard library and never imports
the service. Its single argument is a JSON object (the limits, the work directory).

Order matters: every step that needs root (a network namespace, the resource limits'
hard values, dropping to the `nobody` user) runs before the user's source is compiled, and
the audit hook goes in last so the setup itself is not refused.

Protocol on private pipes (fds dup'ed away from 0 and 1, so the user's print() lands in
the log, not in the protocol): the child writes one `hello` line with the isolation it
achieved, then for each request line `{"sample": {...}, "item": {...}}` one reply line
`{"score": x}` or `{"error": "..."}`.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import resource
import signal
import sys
import traceback

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_NOBODY = 65534

# Process creation: counted, refused past the limit.
_SPAWN_EVENTS = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.spawn",
        "os.exec",
        "os.system",
        "subprocess.Popen",
        "pty.spawn",
    }
)
_NETWORK_EVENTS = frozenset(
    {
        "socket.__new__",
        "socket.connect",
        "socket.bind",
        "socket.sendto",
        "socket.sendmsg",
        "socket.getaddrinfo",
    }
)
# Always refused: foreign calls through ctypes (they would bypass every hook).
_REFUSED_EVENTS = frozenset(
    {
        "ctypes.dlsym",
        "ctypes.dlsym/handle",
        "ctypes.call_function",
        "ctypes.cdata",
    }
)
# File-system changes: allowed inside the work directory only (the event's path arguments).
_PATH_EVENTS = {
    "os.remove": (0,),
    "os.rename": (0, 1),
    "os.mkdir": (0,),
    "os.rmdir": (0,),
    "os.symlink": (1,),
    "os.link": (1,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "os.chdir": (0,),
    "shutil.rmtree": (0,),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
]
_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
# Per-mount flags a read-only remount must keep (nosuid, nodev, noexec, noatime, nodiratime,
# relatime): a bind remount that drops one the mount was locked with is refused.
_KEEP_FLAGS = 2 | 4 | 8 | 1024 | 2048 | (1 << 21)
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 24, 38
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unshare(flags: int) -> bool:
    return _LIBC.unshare(flags) == 0


def _mount(source: bytes | None, target: str, flags: int) -> None:
    if _LIBC.mount(source, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        fields = [line.split() for line in info]
    # mountinfo escapes spaces and the like as \ooo
    return [_OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), f[4]) for f in fields]


def _read_only_but(workdir: str) -> int:
    """In this (new) mount namespace: every mount read-only but `workdir`; returns how
    many mounts could not be remounted (they stay as they were)."""
    _mount(b"none", "/", _MS_REC | _MS_PRIVATE)  # nothing propagates back to the host
    _mount(workdir.encode(), workdir, _MS_BIND | _MS_REC)  # its own mount, left writable
    failed = 0
    for point in _mount_points():
        if point == workdir or point.startswith(workdir + os.sep):
            continue
        try:
            kept = os.statvfs(point).f_flag & _KEEP_FLAGS
            _mount(None, point, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept)
        except OSError:
            failed += 1
    os.chdir(workdir)  # the old working directory is on the parent mount, now read-only
    return failed


def _drop_capabilities() -> bool:
    """Root without capabilities: no remount, no raw sockets, no DAC override, no way back."""
    if _LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    cap = 0
    while _LIBC.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    # capset(v3 header, two empty data words): effective, permitted, inheritable cleared.
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    return _LIBC.capset(header, data) == 0


def _isolate(config: dict) -> dict:
    """Applies the OS-level layers this box permits; returns which ones took."""
    layers: dict = {"network": "audit-hook", "filesystem": "audit-hook"}
    workdir = os.path.realpath(config["workdir"])
    os.chdir(workdir)
    # The resource limits first: as root the hard values can still be set.
    limits = {
        resource.RLIMIT_AS: config["mem_bytes"],
        resource.RLIMIT_CPU: config["cpu_s"],
        resource.RLIMIT_FSIZE: config["file_bytes"],
        resource.RLIMIT_NOFILE: config["open_files"],
        resource.RLIMIT_CORE: 0,
    }
    for kind, value in limits.items():
        _, hard = resource.getrlimit(kind)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))
    # Past RLIMIT_FSIZE a write fails with EFBIG instead of killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if os.geteuid() == 0:
        namespaces = _unshare(_CLONE_NEWNET | _CLONE_NEWNS)
        if not namespaces:
            namespaces = _unshare(_CLONE_NEWNET)
        else:
            left = _read_only_but(workdir)
            layers["filesystem"] = "read-only" if left == 0 else f"read-only but {left} mounts"
        if namespaces:
            layers["network"] = "namespace"
        if config["drop_user"]:
            # RLIMIT_NPROC counts the user's processes and binds only a non-root user.
            resource.setrlimit(resource.RLIMIT_NPROC, (config["nproc"], config["nproc"]))
            os.setgroups([])
            os.setgid(_NOBODY)
            os.setuid(_NOBODY)
            layers["user"] = "nobody"
        else:
            layers["user"] = "root, no capabilities" if _drop_capabilities() else "root"
    else:
        # Unprivileged: a user namespace brings a network namespace with it where allowed.
        if _unshare(_CLONE_NEWUSER | _CLONE_NEWNET):
            layers["network"] = "namespace"
        layers["user"] = "caller"
    # A process the grader starts runs without the audit hook, as the grader's user: as root
    # or as the daemon's own user it could signal the daemon. Only `nobody` starts any,
    # unless told to (tests of the count are).
    confined = layers["user"] == "nobody" or config["unconfined_processes"]
    layers["max_processes"] = config["max_processes"] if confined else 0
    layers["rlimits"] = True
    return layers


def _inside(path: object, workdir: str) -> bool:
    if isinstance(path, int):  # an fd already open: its opening was checked
        return True
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str):
        return False
    full = os.path.realpath(os.path.abspath(path))
    return full == workdir or full.startswith(workdir + os.sep)


def _own_child(pid: object) -> bool:
    """Whether `pid` is a process this one started (signals go to those only)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return False
    return int(fields[1]) == os.getpid()


def _install_hook(config: dict) -> None:
    workdir = os.path.realpath(config["workdir"])
    budget = {"spawns": config["max_processes"]}
    refused = _REFUSED_EVENTS | (_NETWORK_EVENTS if config["audit_network"] else frozenset())

    def hook(event: str, args: tuple) -> None:
        if event in refused:
            raise PermissionError(f"sandbox: {event} is not allowed in a python grader")
        if event in _SPAWN_EVENTS:
            if budget["spawns"] <= 0:
                raise PermissionError(
                    f"sandbox: {event} refused, the grader's process limit "
                    f"({config['max_processes']}) is reached"
                )
            budget["spawns"] -= 1
        elif event in ("os.kill", "os.killpg", "signal.pthread_kill"):
            if not (event == "os.kill" and _own_child(args[0])):
                raise PermissionError(f"sandbox: {event} of another process is not allowed")
        elif not config["audit_writes"]:
            return
        elif event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if writes and not _inside(path, workdir):
                raise PermissionError(f"sandbox: writing {path!r} outside the grader's directory")
        elif event in _PATH_EVENTS:
            for index in _PATH_EVENTS[event]:
                if index < len(args) and not _inside(args[index], workdir):
                    raise PermissionError(f"sandbox: {event} outside the grader's directory")

    sys.addaudithook(hook)


def _score(grade: object, request: dict) -> dict:
    try:
        value = grade(request["sample"], request["item"])  # type: ignore[operator]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"grade() returned {type(value).__name__}, not a number")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"grade() returned {value}")
        return {"score": value}
    except BaseException as exc:  # the user's code: anything it raises is that sample's error
        if isinstance(exc, KeyboardInterrupt):
            raise
        return {"error": "".join(traceback.format_exception_only(exc)).strip()[-2000:]}


def main() -> None:
    config = json.loads(sys.argv[1])
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # the user's print() goes to the log with stderr
    layers = _isolate(config)
    _install_hook(config | {"max_processes": layers["max_processes"]})
    grade = None
    load_error = None
    try:
        namespace: dict = {"__name__": "grader"}
        exec(compile(config["source"], "grader.py", "exec"), namespace)
        grade = namespace.get("grade")
        if not callable(grade):
            load_error = "the source defines no function grade(sample, item)"
    except BaseException as exc:
        load_error = "".join(traceback.format_exception_only(exc)).strip()[-2000:]
    replies.write(json.dumps({"hello": layers, "load_error": load_error}) + "\n")
    replies.flush()
    for line in requests:
        reply = {"error": load_error} if grade is None else _score(grade, json.loads(line))
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


main()
