"""The Triton LoRA kernels on fp8 adapter rows against their torch twins on a CUDA device, in
bf16 and fp16 at Llama shapes (pages of 4096 and 1024 elements, rows of 1 to 14 sub-pages, ranks
1 to 64), on the tiled, vector and mixed paths.

Run on the device machine:
``.venv/bin/python -m pytest -q -m gpu tests/kernels/test_fp8_adapters_gpu.py``.
The case builder is test_fp8_adapters_rows.py's; the checks are the interpreter test's.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_fp8_adapters_interpret import check_groups
from test_fp8_adapters_rows import fp8_case

from slora_kernels.meta import VECTOR_ALL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels only"),
]

MODELS = {  # name: (dims of q, k and down, page size = kv_dim)
    "llama2-7b": ({"q": (4096, 4096), "k": (4096, 4096), "down": (11008, 4096)}, 4096),
    "llama3-8b": ({"q": (4096, 4096), "k": (4096, 1024), "down": (14336, 4096)}, 1024),
}
PATHS = {"tiled": 0, "vector": VECTOR_ALL, "both": 8}


@pytest.fixture(scope="module")
def kernels():
    from slora_kernels import lora_expand, lora_shrink

    return lora_shrink.lora_shrink, lora_expand.lora_expand


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("num_tokens", [64, 300])
def test_kernels_on_fp8_rows_match_twins(kernels, dtype, model, path, num_tokens):
    dims, page = MODELS[model]
    case = fp8_case(ranks=[8, 64, 1, 16, 32, 5], num_tokens=num_tokens, dtype=dtype,
                    seed=num_tokens, page=page, dims=dims, bias_slots=(2,),
                    device="cuda")  # fmt: skip
    case.meta.vector_max = PATHS[path]
    check_groups(*kernels, case, dtype, seed=3)
