"""The bench scripts' tests run each script as a user would: a subprocess from the checkout's root, the package on
PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_bench() -> Callable[..., subprocess.CompletedProcess]:
    """run_bench("bench/x.py", *flags, timeout=600, env=None) → the finished process (stdout and stderr as text);
    `env` adds variables to this process's."""

    def run(script: str, *flags: str, timeout: int = 600, env: dict[str, str] | None = None):
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        cmd = [sys.executable, script, *flags]
        return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)

    return run
