"""Markers say what a test costs: every module under tests/integration/ starts real processes and is
marked ``integration``; nothing under tests/unit/ asks for a stack fixture."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
STACK_FIXTURES = {"stack", "llm_stack", "paced_stack", "grpc_client", "demo_repository", "llm_repository"}


def _marks(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            return {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)}
    return set()


@pytest.mark.parametrize("path", sorted((TESTS / "integration").glob("test_*.py")), ids=lambda p: p.name)
def test_integration_modules_are_marked(path):
    assert "integration" in _marks(ast.parse(path.read_text())), f"{path.name} starts real processes: pytestmark = pytest.mark.integration"


@pytest.mark.parametrize("path", sorted((TESTS / "unit").glob("test_*.py")), ids=lambda p: p.name)
def test_unit_modules_start_no_stack(path):
    tree = ast.parse(path.read_text())
    asked = {
        a.arg
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
        for a in node.args.args
    }
    assert not asked & STACK_FIXTURES, f"{path.name} asks for {sorted(asked & STACK_FIXTURES)}: it belongs in tests/integration/"
    assert "integration" not in _marks(tree)
