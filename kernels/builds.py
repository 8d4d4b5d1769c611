"""Triton kernel builds seen while a block of code runs: which kernels were built (compiled, or
loaded from Triton's disk cache) and how long each took, so a timed run can tell a build from a
slow step.

Triton builds one binary per kernel, constexpr set and integer specialization, the first time a
launch asks for it in a process. A step whose block shapes no earlier step used (a new largest
rank, a prefill large enough to drop the split reduction) waits for its build: about a second,
once per process, then milliseconds from the disk cache.

    with BuildLog() as builds:
        run_the_timed_part()
    builds.count, builds.seconds, builds.names  # 2, 1.7, ['_shrink_kernel', '_expand_kernel']

Uses ``triton.knobs.runtime``'s JIT hooks (Triton 3.4 and later); where they are missing (or
under the interpreter, which builds nothing) ``available`` is False and nothing is recorded.
"""

from __future__ import annotations

import time

import triton


class BuildLog:
    """Records the Triton builds inside a ``with`` block; hooks set before it are still called."""

    def __init__(self) -> None:
        self.builds: list[tuple[str, float]] = []  # (kernel name, seconds)
        self.details: list[str] = []  # Triton's text for each build: its argument specialization
        self.ended: list[float] = []  # each build's end, time.perf_counter()
        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        hooks = ("jit_cache_hook", "jit_post_compile_hook")
        self._runtime = runtime if all(hasattr(runtime, h) for h in hooks) else None
        self._started = 0.0
        self._saved: tuple = (None, None)

    @property
    def available(self) -> bool:
        return self._runtime is not None

    @property
    def count(self) -> int:
        return len(self.builds)

    @property
    def seconds(self) -> float:
        return sum(seconds for _, seconds in self.builds)

    def since(self, moment: float) -> tuple[int, float]:
        """(builds, their seconds) of the builds that ended after ``moment`` (perf_counter)."""
        late = [
            seconds
            for (_, seconds), end in zip(self.builds, self.ended, strict=True)
            if end > moment
        ]
        return len(late), sum(late)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.builds]

    def __enter__(self) -> BuildLog:
        if self._runtime is not None:
            self._saved = (self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook)
            self._runtime.jit_cache_hook = self._before
            self._runtime.jit_post_compile_hook = self._after
        return self

    def __exit__(self, *exc) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = self._saved

    def _before(self, *args, **kwargs):
        """Called before a build; a true return would skip it, so pass on the earlier hook's."""
        self._started = time.perf_counter()
        earlier = self._saved[0]
        return earlier(*args, **kwargs) if earlier is not None else False

    def _after(self, *args, **kwargs):
        fn = kwargs.get("fn")
        now = time.perf_counter()
        self.builds.append((getattr(fn, "name", "?"), now - self._started))
        self.ended.append(now)
        self.details.append(str(kwargs.get("repr", "")))
        earlier = self._saved[1]
        return earlier(*args, **kwargs) if earlier is not None else None
