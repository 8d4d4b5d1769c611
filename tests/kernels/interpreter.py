"""Running a kernel test module's tests in a child process under Triton's interpreter: the
interpreter is chosen when ``triton`` is first imported, so a process that imported it to compile
cannot switch (``TRITON_INTERPRET=1`` must be set before the kernel modules are imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_interpreted(test_file: str, *pytest_args: str, timeout: int = 600) -> str:
    """Run ``test_file``'s tests (with ``pytest_args``, e.g. ``-k``) with TRITON_INTERPRET=1 in a
    child pytest, without xdist workers; fail with its output unless all passed. Its stdout."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"]
        + ["-o", "addopts=", "--tb=short", *pytest_args],
        cwd=Path(__file__).resolve().parents[2],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-12000:] + proc.stderr[-3000:]
    return proc.stdout
