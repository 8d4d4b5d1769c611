"""Running a kernel test module's tests in a child process under Triton's interpreter: the
interpreter is chosen when ``triton`` is first imported, so a process that imported it to compile
cannot switch (``TRITON_INTERPRET=1`` must be set before the kernel modules are imported).

In that process (``INTERPRETED``), importing this module also spares the interpreter a repeat
of work it does at every call of a ``@triton.jit`` helper (``patch_language_once``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def patch_language_once() -> bool:
    """Triton's interpreter patches ``triton.language`` (its builtins, found by
    ``inspect.getmembers``) for a launch and restores it after; it patches the same modules
    again, never restored, at each call of a ``@triton.jit`` helper inside the launch: about
    4 ms a call, a fifth of these tests' time (the LoRA kernels call 3 or 4 helpers a program).
    Here a helper whose language modules the launch in progress already patched skips the
    repeat; the launch's own patch and restore stay Triton's. False (nothing changed) where
    the interpreter lacks the pieces this relies on."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch, launch = (getattr(interpreter, name, None) for name in ("_patch_lang", "GridExecutor"))
    if patch is None or launch is None or not hasattr(interpreter, "_LangPatchScope"):
        return False
    if getattr(patch, "once", False):
        return True
    patched: list[set] = []  # the language modules each launch in progress patched

    def languages(fn) -> set:
        return {value for value in fn.__globals__.values() if value is tl or value is tl.core}

    def patch_once(fn):
        if patched and languages(fn) <= patched[-1]:
            return interpreter._LangPatchScope()  # nothing patched, nothing to restore
        scope = patch(fn)
        patched.append(languages(fn))
        return scope

    def run_launch(self, *args, **kwargs):
        depth = len(patched)
        try:
            return run(self, *args, **kwargs)
        finally:
            del patched[depth:]

    run = launch.__call__
    patch_once.once = True
    interpreter._patch_lang = patch_once
    launch.__call__ = run_launch
    return True


if INTERPRETED:
    patch_language_once()


def run_interpreted(*tests: str, timeout: int = 600) -> str:
    """Run ``tests`` (files or node ids, and pytest options such as ``-k``) with
    TRITON_INTERPRET=1 in one child pytest, without xdist workers: one start of Python, torch and
    Triton (about 5 s) for all of them. Fails with its output unless all passed; its stdout."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider"]
        + ["-o", "addopts=", "--tb=short"],
        cwd=Path(__file__).resolve().parents[2],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-12000:] + proc.stderr[-3000:]
    return proc.stdout
