"""K3STREAM_REQUIRE_ORACLE=1 (set by CI) turns a missing llama.cpp oracle into failures, not skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
# pytest on one llama.cpp-oracle test, in a Python where `llama_cpp` cannot be found (in this process,
# `-n 0`: the workers of `-n 2` would not have the patch)
WITHOUT_ORACLE = """
import importlib.util, sys
import pytest
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *args: None if name == "llama_cpp" else find_spec(name, *args)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-n", "0", sys.argv[1]]))
"""


def _run_without_oracle(require: str | None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "K3STREAM_REQUIRE_ORACLE"}
    if require is not None:
        env["K3STREAM_REQUIRE_ORACLE"] = require
    oracle_test = f"{TESTS / 'test_tokenizer.py'}::test_special_token_ids_match_llama_cpp"
    command = [sys.executable, "-c", WITHOUT_ORACLE, oracle_test]
    return subprocess.run(command, cwd=TESTS, env=env, capture_output=True, text=True, timeout=300)


def test_a_missing_oracle_skips_by_default():
    done = _run_without_oracle(None)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped" in done.stdout


def test_a_missing_oracle_fails_when_required():
    done = _run_without_oracle("1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "K3STREAM_REQUIRE_ORACLE=1 but llama-cpp-python 0.3.36" in done.stdout
