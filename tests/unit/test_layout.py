"""The import direction of ``server/README.md``, checked over every module with ``ast``.

A room may import only what its row of the table allows; a violation names the file, the line
and the import, so the message says what to move.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = {"settings", "errors", "db", "migrations", "protogen", "__init__"}
# room -> rooms of server/ it may import (besides the shared modules)
ALLOWED = {
    "transports": {"transports", "dataplane", "control", "tenancy"},
    "control": {"control", "dataplane", "tenancy", "runtime"},
    "dataplane": {"dataplane", "tenancy"},
    "tenancy": {"tenancy"},
    "runtime": {"runtime", "dataplane.backend", "dataplane.backend_errors", "dataplane.wire", "dataplane.triton_client", "dataplane.batch_codec"},
    "cli": {"cli", "app", "dataplane", "control", "tenancy", "runtime"},
    "app": None,  # the wiring may import anything
}
ALLOWED.update({name: set() for name in SHARED})


def _imports(path: Path):
    """(line, dotted module) of every import in a file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            yield node.lineno, module
            for alias in node.names:  # `from server import codecs` imports server.codecs
                yield node.lineno, f"{module}.{alias.name}"


def _modules(folder: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        if "protogen" not in path.parts:
            yield path


def _room(path: Path) -> str:
    parts = path.relative_to(ROOT / "server").with_suffix("").parts
    return parts[0]


def _target(module: str) -> str | None:
    """The room (or shared module) of a ``server.`` import; None for other packages."""
    parts = module.split(".")
    if parts[0] != "server" or len(parts) == 1:
        return None
    return ".".join(parts[1:])


def _allowed(room: str, target: str) -> bool:
    allowed = ALLOWED[room]
    if allowed is None:
        return True
    head = target.split(".")[0]
    if head in SHARED or head == "__version__":
        return True
    return any(target == a or target.startswith(a + ".") or head == a for a in allowed)


def test_every_room_has_a_row():
    rooms = {_room(p) for p in _modules("server")}
    assert rooms <= set(ALLOWED), f"rooms without an import rule in server/README.md: {sorted(rooms - set(ALLOWED))}"


def test_server_rooms_import_one_way():
    bad = []
    for path in _modules("server"):
        room = _room(path)
        for line, module in _imports(path):
            target = _target(module)
            if target is not None and not _allowed(room, target):
                bad.append(f"{path.relative_to(ROOT)}:{line} ({room}) imports server.{target}")
    assert not bad, "imports against the direction of server/README.md:\n" + "\n".join(bad)


@pytest.mark.parametrize("folder", ["server", "batching", "model_repository"])
def test_nothing_imports_loadtest(folder):
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {m}"
        for p in _modules(folder)
        for line, m in _imports(p)
        if m == "loadtest" or m.startswith("loadtest.")
    ]
    assert not bad, "\n".join(bad)


def test_batching_imports_nothing_of_server():
    bad = [f"{p.relative_to(ROOT)}:{line} imports {m}" for p in _modules("batching") for line, m in _imports(p) if m.split(".")[0] == "server"]
    assert not bad, "batching/ is pure policy:\n" + "\n".join(bad)


def test_model_repository_imports_only_protogen():
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {m}"
        for p in _modules("model_repository")
        for line, m in _imports(p)
        if m.split(".")[0] == "server" and m != "server" and not m.startswith("server.protogen")
    ]
    assert not bad, "\n".join(bad)


def test_optimizer_uses_public_names_only():
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {m}"
        for p in _modules("optimizer")
        for line, m in _imports(p)
        if m.split(".")[0] == "server" and any(part.startswith("_") for part in m.split(".")[1:])
    ]
    assert not bad, "\n".join(bad)


def _environment_reads(path: Path):
    """Reads of the environment: ``os.environ.get``, ``os.getenv``, ``os.environ[...]`` loads, typer's
    ``envvar=``. Copies handed to a child process (``dict(os.environ, ...)``) and writes for a library
    that reads its own variable (prometheus-client, grpc) are not settings reads."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "envvar":
            yield node.value.lineno, "typer envvar="
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"):
            continue
        if node.attr == "getenv":
            yield node.lineno, "os.getenv"
        if node.attr != "environ":
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.attr in ("get", "pop", "items", "keys", "values", "copy"):
            yield node.lineno, f"os.environ.{parent.attr}"
        elif isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Load):
            yield node.lineno, "os.environ[...]"
        elif isinstance(parent, ast.Compare):
            yield node.lineno, "a key in os.environ"


# process-environment plumbing that is not configuration: what child processes inherit
ENVIRONMENT_PLUMBING = {
    "server/runtime/capi.py": "PATH / LD_LIBRARY_PATH / OMP_NUM_THREADS set for the in-process Triton's stub children, then restored",
}


def test_only_settings_read_the_environment():
    bad = [
        f"{p.relative_to(ROOT)}:{line} {what}"
        for p in _modules("server")
        if p.name != "settings.py" and str(p.relative_to(ROOT)) not in ENVIRONMENT_PLUMBING
        for line, what in _environment_reads(p)
    ]
    assert not bad, "server/settings.py is the only module that reads the environment:\n" + "\n".join(bad)
