"""The import direction of ``server/README.md``, checked over every module with ``ast``.

A room may import only what its row of the table allows; a violation names the file, the line
and the import, so the message says what to move.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = {"settings", "errors", "db", "migrations", "protogen", "periodic", "__init__"}
# room -> rooms of server/ it may import (besides the shared modules)
ALLOWED = {
    "transports": {"transports", "dataplane", "control", "tenancy"},
    "control": {"control", "dataplane", "tenancy", "runtime"},
    "dataplane": {"dataplane", "tenancy"},
    "tenancy": {"tenancy"},
    "runtime": {"runtime", "dataplane.backend", "dataplane.backend_errors", "dataplane.wire", "dataplane.triton_client", "dataplane.batch_codec"},
    "cli": {"cli", "app", "dataplane", "control", "tenancy", "runtime"},
    "app": None,  # the wiring may import anything
    "composition": None,  # the wiring's tables: every transport's routes, the row runner
    "roles": None,  # the wiring's process roles: the control role (leader, follower) and the ports
}
ALLOWED.update({name: set() for name in SHARED})


def _once_per_version(scan):
    """``scan(path)``'s answer computed once per version of the file (its mtime and size): every test
    here walks all of server/."""
    cached = functools.lru_cache(maxsize=None)(lambda path, mtime_ns, size: tuple(scan(path)))

    @functools.wraps(scan)
    def wrapper(path: Path):
        stat = path.stat()
        return cached(path, stat.st_mtime_ns, stat.st_size)

    return wrapper


@_once_per_version
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


@_once_per_version
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


# ---- the model port's features call the port, never what implements it ------------------------------

# the features that call server/dataplane/port.py (server/README.md, the dataplane row)
PORT_FEATURES = ("server/dataplane/generation.py", "server/dataplane/composite.py", "server/dataplane/safety.py", "server/transports/batch_rows.py")
# the port's implementation and its parts: the data plane, its pipeline, its backend and the engine calls
BEHIND_THE_PORT = (
    "server.dataplane.dataplane", "server.dataplane.builder", "server.dataplane.pipeline", "server.dataplane.engine_calls",
    "server.dataplane.backend", "server.dataplane.triton_client", "server.dataplane.replicas", "server.runtime",
)  # fmt: skip


def test_the_ports_features_import_the_port_not_what_implements_it():
    bad = [
        f"{path}:{line} imports {m}"
        for path in PORT_FEATURES
        for line, m in _imports(ROOT / path)
        if any(m == behind or m.startswith(behind + ".") for behind in BEHIND_THE_PORT)
    ]
    assert not bad, "a feature of the model port reaches behind it (call server.dataplane.port instead):\n" + "\n".join(bad)


# ---- no cycle inside a room; no import inside a function that dodges one ----------------------------


@_once_per_version
def _placed_imports(path: Path):
    """(line, dotted module, inside a function) of every import of a file. An import under
    ``if TYPE_CHECKING:`` counts like any other: a type named back is a tie back."""
    tree = ast.parse(path.read_text(), str(path))
    in_function = {n.lineno for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom)}
    for line, module in _imports(path):
        yield line, module, line in in_function


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _cycles(room: Path) -> list[list[str]]:
    """The import cycles among the modules of ``room`` and its sub-packages (Tarjan's strongly connected
    components of more than one module), each as sorted module names; imports inside functions and
    under TYPE_CHECKING count."""
    modules = {_module_name(p): p for p in _modules(str(room.relative_to(ROOT))) if p.name != "__init__.py"}
    return _strongly_connected({m: sorted({t for _, t, _ in _placed_imports(p) if t in modules and t != m}) for m, p in modules.items()})


def _strongly_connected(edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node of ``edges`` (node -> the nodes it
    points at), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by a room's module count
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def _part_of(path: Path, parent: Path) -> str:
    """The direct part of ``parent`` (a sub-package or a module) that ``path`` lies in."""
    return path.relative_to(parent).parts[0].removesuffix(".py")


def _part_ties(parent: Path) -> dict[str, list[str]]:
    """part -> the other parts of ``parent`` that one of its modules imports (inside functions too)."""
    prefix = _module_name(parent) + "."
    ties: dict[str, set[str]] = {}
    for path in _modules(str(parent.relative_to(ROOT))):
        if path.parent == parent and path.name == "__init__.py":
            continue
        part = _part_of(path, parent)
        ties.setdefault(part, set())
        for _, module, _ in _placed_imports(path):
            if module.startswith(prefix):
                other = module[len(prefix):].split(".")[0]
                if other != part and other != "__init__":
                    ties[part].add(other)
    return {part: sorted(others) for part, others in ties.items()}


# rooms whose sub-packages are rooms of their own: they stand on floors, no sub-package imports one that imports it
LAYERED_ROOMS = ("server/control", "server/transports")


@pytest.mark.parametrize("room", LAYERED_ROOMS)
def test_the_sub_packages_of_a_room_import_one_way(room):
    ties = _part_ties(ROOT / room)
    assert len(ties) >= 4, f"{room}: the test sees too few parts ({sorted(ties)})"
    cycles = _strongly_connected({part: [o for o in others if o in ties] for part, others in ties.items()})
    assert not cycles, f"parts of {room} that import each other (a floor imports one above it):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_part_cycle_finder_finds_one(tmp_path, monkeypatch):
    room = tmp_path / "server" / "room"
    for part in ("low", "high"):
        (room / part).mkdir(parents=True)
        (room / part / "__init__.py").write_text("")
    (room / "__init__.py").write_text("")
    (room / "high" / "a.py").write_text("from server.room.low import b\n")
    (room / "low" / "b.py").write_text("def late():\n    from server.room.high.a import x\n")
    (room / "edge.py").write_text("from server.room.low.b import late\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    ties = _part_ties(room)
    assert ties == {"high": ["low"], "low": ["high"], "edge": ["low"]}
    assert _strongly_connected(ties) == [["high", "low"]]


def _rooms() -> list[Path]:
    """Every package of server/ (a room, and each sub-package a room of its own), protogen aside."""
    return sorted({p.parent for p in _modules("server") if p.name == "__init__.py" and p.parent != ROOT / "server"})


# rooms whose cycle another change removes (each entry must still have one: the test says when to drop it)
CYCLES_PENDING: dict[str, str] = {}  # room -> why its cycle is still there (none: every room is free of them)


def test_rooms_the_test_walks():
    rooms = {str(r.relative_to(ROOT)) for r in _rooms()}
    assert {"server/control", "server/control/registry", "server/control/rollout", "server/dataplane"} <= rooms
    assert set(CYCLES_PENDING) <= rooms, f"pending entries for rooms that do not exist: {sorted(set(CYCLES_PENDING) - rooms)}"


@pytest.mark.parametrize("room", [str(r.relative_to(ROOT)) for r in _rooms()])
def test_no_import_cycle_inside_a_room(room):
    cycles = _cycles(ROOT / room)
    if room in CYCLES_PENDING:
        assert cycles, f"{room} has no cycle any more: drop its CYCLES_PENDING entry"
        return
    assert not cycles, f"import cycles inside {room} (imports in functions count):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_one(tmp_path, monkeypatch):
    room = tmp_path / "server" / "room"
    room.mkdir(parents=True)
    (room / "__init__.py").write_text("")
    (room / "a.py").write_text("from server.room import b\n")
    (room / "b.py").write_text("def late():\n    from server.room.a import x\n")
    (room / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from server.room import d\n")
    (room / "d.py").write_text("from server.room.c import x\n")
    (room / "e.py").write_text("from server.room import a\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert sorted(_cycles(room)) == [["server.room.a", "server.room.b"], ["server.room.c", "server.room.d"]]  # not e: it only imports
    assert [(module, inside) for _, module, inside in _placed_imports(room / "b.py")] == [("server.room.a", True), ("server.room.a.x", True)]


# rooms where an import inside a function needs a reason (their cycles are gone; what is left is an
# optional or heavy dependency used on one path only)
NO_IMPORTS_IN_FUNCTIONS = (
    "server/control", "server/tenancy", "server/runtime", "server/dataplane", "server/transports", "server/app.py", "server/composition.py",
    "server/roles.py",
)  # fmt: skip
# (file, imported module) -> why it is imported where it is used
IMPORTS_IN_FUNCTIONS = {
    ("server/control/scaling/kubernetes_executor.py", "kubernetes"): "the Kubernetes client (~1 s to import), only with a cluster",
    ("server/control/scaling/kubernetes_executor.py", "kubernetes.client.exceptions"): "the Kubernetes client, only with a cluster",
    ("server/control/scaling/kubernetes_executor.py", "urllib3.exceptions"): "what the Kubernetes client raises, only with a cluster",
    ("server/control/registry/safe_formats.py", "onnx"): "onnx (heavy), only to check an ONNX artifact",
    ("server/tenancy/redis_quotas.py", "redis"): "the Redis client, only with INFERPLANE_REDIS_URL",
    ("server/tenancy/redis_quotas.py", "redis.exceptions"): "what the Redis client raises, only with a Redis quota store",
    ("server/tenancy/monthly_quotas.py", "redis.exceptions"): "what the Redis client raises, only with a Redis quota store",
    ("server/runtime/workers.py", "prometheus_client"): "prometheus_client.multiprocess, only in the parent of --workers N",
    ("server/dataplane/idempotency.py", "redis"): "the Redis client, only with INFERPLANE_REDIS_URL",
    ("server/dataplane/feature_store.py", "redis"): "the Redis client, only with a Redis feature store",
    ("server/dataplane/tracing.py", "opentelemetry"): "OpenTelemetry's API, only when traces are exported (an OTLP endpoint is set)",
    ("server/dataplane/tracing.py", "opentelemetry.exporter.otlp.proto.http.trace_exporter"): "the OTLP exporter, only with an OTLP endpoint",
    ("server/dataplane/tracing.py", "opentelemetry.sdk.resources"): "OpenTelemetry's SDK, only with an OTLP endpoint",
    ("server/dataplane/tracing.py", "opentelemetry.sdk.trace"): "OpenTelemetry's SDK, only with an OTLP endpoint",
    ("server/dataplane/tracing.py", "opentelemetry.sdk.trace.export"): "OpenTelemetry's SDK, only with an OTLP endpoint",
    ("server/dataplane/tracing.py", "opentelemetry.sdk.trace.sampling"): "OpenTelemetry's SDK, only with an OTLP endpoint",
    ("server/dataplane/composite.py", "opentelemetry"): "OpenTelemetry's API, only on a traced composite node that failed",
    ("server/app.py", "uvloop"): "the event loop's ImportError fallback (asyncio's own loop)",
    ("server/app.py", "server.control.service.control_plane"): "the control plane's writers (~1.5 s of imports), only in the process that may lead: never in a worker of --workers N",
    ("server/app.py", "server.runtime.inprocess"): "libtritonserver's bindings, only with --triton-mode in-process",
}


def _imports_in_functions():
    for folder in NO_IMPORTS_IN_FUNCTIONS:
        for path in [ROOT / folder] if folder.endswith(".py") else _modules(folder):
            rel = str(path.relative_to(ROOT))
            seen = set()
            for line, module, inside in _placed_imports(path):
                if inside and line not in seen:
                    seen.add(line)
                    yield rel, line, module


# server/cli is not in NO_IMPORTS_IN_FUNCTIONS: a command imports what only it runs there, so that
# `inferplane --help` (and every command's start) reads no control plane, data plane or database layer
CLI_STARTS_WITHOUT = ("server.app", "server.control", "server.dataplane", "server.tenancy", "sqlalchemy", "numpy", "tritonclient")


def test_the_cli_starts_without_the_heavy_rooms():
    code = "import sys, server.cli.main; print('\\n'.join(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
    heavy = sorted(m for m in loaded if m.startswith(CLI_STARTS_WITHOUT))
    assert not heavy, "server.cli.main imports these at its start (import them inside the command that needs them):\n" + "\n".join(heavy)


def test_imports_in_functions_have_a_reason():
    bad = [f"{rel}:{line} imports {module} inside a function" for rel, line, module in _imports_in_functions() if (rel, module) not in IMPORTS_IN_FUNCTIONS]
    assert not bad, "import at the top of the module (or add an entry with the reason to IMPORTS_IN_FUNCTIONS):\n" + "\n".join(bad)


def test_every_allowed_import_in_a_function_is_still_there():
    present = {(rel, module) for rel, _, module in _imports_in_functions()}
    assert not set(IMPORTS_IN_FUNCTIONS) - present, f"stale entries: {sorted(set(IMPORTS_IN_FUNCTIONS) - present)}"
