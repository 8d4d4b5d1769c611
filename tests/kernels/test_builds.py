"""slora_kernels.builds.BuildLog: the Triton builds inside a block, as the bench counts them in its
timed runs."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from slora_kernels import builds as builds_module
from slora_kernels.builds import BuildLog

runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
hooked = pytest.mark.skipif(
    not hasattr(runtime, "jit_post_compile_hook"), reason="Triton without JIT hooks"
)


@hooked
def test_hooks_set_inside_the_block_and_chained(monkeypatch):
    """Inside the block both hooks are the log's: the one before a build returns False (True
    would skip the build) or what an earlier hook returns, and both call the earlier hooks with
    Triton's arguments; after the block the earlier hooks are back. Each build's seconds are
    the clock's from the hook before it to the hook after it."""
    clock = iter([10.0, 10.25, 20.0, 20.5])  # before, after the first build; the second's
    monkeypatch.setattr(builds_module.time, "perf_counter", lambda: next(clock))
    calls = []
    saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    fn = type("JitFunctionInfo", (), {"name": "_shrink_kernel"})()
    try:
        runtime.jit_cache_hook = lambda **kw: calls.append(("before", kw["fn"].name))
        runtime.jit_post_compile_hook = lambda **kw: calls.append(("after", kw["fn"].name))
        earlier = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        with BuildLog() as builds:
            assert builds.available
            assert runtime.jit_cache_hook != earlier[0]
            assert not runtime.jit_cache_hook(key="k", fn=fn)
            runtime.jit_post_compile_hook(key="k", fn=fn, repr="_shrink_kernel[num_warps=4](x)")
            fn.name = "_expand_kernel"
            runtime.jit_cache_hook(key="k", fn=fn)
            runtime.jit_post_compile_hook(key="k", fn=fn)
        assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == earlier
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved
    assert builds.count == 2 and builds.names == ["_shrink_kernel", "_expand_kernel"]
    assert builds.builds == [("_shrink_kernel", 0.25), ("_expand_kernel", 0.5)]
    assert builds.seconds == 0.75
    assert builds.details == ["_shrink_kernel[num_warps=4](x)", ""]
    assert builds.ended == [10.25, 20.5]  # since(t): the builds that ended after t
    assert builds.since(10.25) == (1, 0.5) and builds.since(0.0) == (2, 0.75)
    assert builds.since(20.5) == (0, 0)
    assert calls == [
        ("before", "_shrink_kernel"),
        ("after", "_shrink_kernel"),
        ("before", "_expand_kernel"),
        ("after", "_expand_kernel"),
    ]


@triton.jit
def _scale_kernel(x_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * FACTOR, mask=offs < n)


@pytest.mark.gpu
@hooked
def test_counts_real_builds_once_per_block_shape():
    """A launch with a block shape not built before in this process is one build; the same
    launch again is none."""
    x = torch.ones(100, device="cuda")
    factor = 3 + torch.randint(0, 1000, ()).item()  # a constexpr no earlier test built
    with BuildLog() as first:
        _scale_kernel[(1,)](x, 100, FACTOR=factor, BLOCK=128)
    with BuildLog() as again:
        _scale_kernel[(1,)](x, 100, FACTOR=factor, BLOCK=128)
    torch.cuda.synchronize()
    assert first.names == ["_scale_kernel"] and first.seconds > 0
    assert again.count == 0
    assert float(x[0]) == factor * factor
