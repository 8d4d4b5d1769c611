"""Running a kernel test module's tests in a child process under Triton's interpreter: the
interpreter is chosen when ``triton`` is first imported, so a process that imported it to compile
cannot switch (``TRITON_INTERPRET=1`` must be set before the kernel modules are imported).

In that process (``INTERPRETED``), importing this module also spares the interpreter work whose
result it never uses (``speed_up_interpreter``): the kernels run the same operations on the same
values, in about half the time; and its casts to e4m3 round as the GPU's do
(``round_e4m3_as_the_gpu``).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def speed_up_interpreter() -> dict[str, bool]:
    """Each of the interpreter shortcuts below, applied where this Triton has the pieces it
    relies on (True) and left out where not (False): the tests then only run slower."""
    from triton.runtime import interpreter

    return {
        "language patched once a launch": patch_language_once(interpreter),
        "no dead overflow checks": skip_dead_overflow_checks(interpreter),
        "numpy dtypes looked up once": cache_numpy_dtypes(interpreter),
    }


def patch_language_once(interpreter) -> bool:
    """The interpreter patches ``triton.language`` (its builtins, found by
    ``inspect.getmembers``) for a launch and restores it after; it patches the same modules
    again, never restored, at each call of a ``@triton.jit`` helper inside the launch: about
    4 ms a call, a fifth or more of these tests' time (the LoRA kernels call 3 or 4 helpers a
    program). Here a helper whose language modules the launch in progress already patched skips
    the repeat; the launch's own patch and restore stay Triton's."""
    import triton.language as tl

    patch, launch = (getattr(interpreter, name, None) for name in ("_patch_lang", "GridExecutor"))
    if patch is None or launch is None or not hasattr(interpreter, "_LangPatchScope"):
        return False
    if getattr(patch, "once", False):
        return True
    patched: list[set] = []  # the language modules each launch in progress patched

    def languages(fn) -> set:
        return {value for value in fn.__globals__.values() if value is tl or value is tl.core}

    def patch_once(fn):
        mine = languages(fn)  # none: Triton's patch fails as it would have
        if patched and mine and mine <= patched[-1]:
            return interpreter._LangPatchScope()  # nothing patched, nothing to restore
        scope = patch(fn)
        patched.append(mine)
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


def skip_dead_overflow_checks(interpreter) -> bool:
    """The interpreter builds an int64 overflow check around each int32 add, sub and mul
    (``sanitize_overflow``) and hands it to ``device_assert``, which returns at once unless its
    options' ``debug`` is on, and the interpreter's never is: the check asserts nothing, yet it
    takes about a quarter of these tests' time. Here it is not built while ``debug`` is off."""
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or not hasattr(options, "sanitize_overflow"):
        return False
    if getattr(options, "debug", True):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


def cache_numpy_dtypes(interpreter) -> bool:
    """The interpreter maps a Triton dtype to numpy's by building a table of all of them at
    each of its operations' calls; here each element type's answer is kept after its first
    call (pointers, unhashable, still ask Triton each time)."""
    import triton.language as tl

    lookup = getattr(interpreter, "_get_np_dtype", None)
    if lookup is None:
        return False
    if getattr(lookup, "cached", False):
        return True
    known = {}

    def numpy_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return lookup(scalar)
        if scalar not in known:
            known[scalar] = lookup(scalar)
        return known[scalar]

    numpy_dtype.cached = True
    interpreter._get_np_dtype = numpy_dtype
    return True


def round_e4m3_as_the_gpu() -> bool:
    """The interpreter's cast to e4m3 (``_convert_float``) adds the rounding bit to the mantissa
    without carrying it into the exponent: 125.2 becomes 64 where the GPU's ``cvt.rn`` gives
    128. Here casts from fp32, fp16 and bf16 to e4m3 go through torch's, which rounds to the
    nearest even as the GPU does (the kernels clamp to +-448 first, as the GPU saturates)."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    convert = getattr(interpreter, "_convert_float", None)
    if convert is None:
        return False
    if getattr(convert, "e4m3", False):
        return True
    views = {tl.float32: (np.float32, None), tl.float16: (np.float16, None),
             tl.bfloat16: (np.int16, torch.bfloat16)}  # fmt: skip

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype != tl.float8e4nv or input_dtype not in views:
            return convert(data, input_dtype, output_dtype, rounding_mode)
        storage, torch_dtype = views[input_dtype]
        values = torch.from_numpy(np.ascontiguousarray(data).view(storage))
        values = values.view(torch_dtype) if torch_dtype is not None else values
        return values.float().to(torch.float8_e4m3fn).view(torch.uint8).numpy()

    convert_float.e4m3 = True
    interpreter._convert_float = convert_float
    return True


if INTERPRETED:
    speed_up_interpreter()
    round_e4m3_as_the_gpu()


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
