"""Every skip says how to get what it misses on a fresh machine: no path that only CI has, and each
`importorskip` with its reason (pytest's default names the module and nothing more)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import LLAMA_MISSING, requires_llama

TESTS = Path(__file__).parent
CI_ONLY_WHEELS = Path("shared", "wheels").as_posix()  # spelled so that this file does not name it


def test_llama_skips_say_how_to_install_it_from_pypi():
    assert requires_llama.kwargs["reason"] == LLAMA_MISSING
    assert "pip install llama-cpp-python==0.3.36" in LLAMA_MISSING
    assert "C++ compiler and cmake" in LLAMA_MISSING


@pytest.mark.parametrize("path", sorted(TESTS.glob("*.py")), ids=lambda path: path.name)
def test_skips_name_no_ci_only_path_and_give_a_reason(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            assert CI_ONLY_WHEELS not in node.value, f"{path.name}:{node.lineno}"
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip":
            assert any(keyword.arg == "reason" for keyword in node.keywords), f"{path.name}:{node.lineno}"
