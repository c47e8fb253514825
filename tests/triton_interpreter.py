"""Kernel tests under Triton's CPU interpreter: Triton reads TRITON_INTERPRET at import, so a test
file runs itself again in a child pytest with it set; the parent's one test is that child's result."""

from __future__ import annotations

import os
import subprocess
import sys

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # True in the child


def run_interpreted(test_file: str) -> None:
    """Runs `test_file` under the interpreter; fails with the child's output unless every test passed."""
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                           env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and " skipped" not in child.stdout, child.stdout[-2000:]
