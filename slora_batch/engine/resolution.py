"""What an engine of a config runs on, decided without building it: the device kind, the dtype
and the kernel backend that ``device``, ``dtype`` and ``backend`` of ``auto`` resolve to. The
engine resolves through these rules (``memory.pick_dtype``, ``parts.pick_backend``), and the
job manifest records and compares what they give, so an output made in float32 on a CPU is
not resumed in bfloat16 on a GPU. Imports torch only to ask whether a GPU is there."""

from __future__ import annotations

from slora_batch.engine.config import EngineConfig


def dtype_name(name: str, device_kind: str) -> str:
    """``dtype`` resolved: ``auto`` is bfloat16 on cuda, float32 elsewhere."""
    if name != "auto":
        return name
    return "bfloat16" if device_kind == "cuda" else "float32"


def backend_name(name: str, device_kind: str) -> str:
    """``backend`` resolved: ``auto`` is the Triton kernels on cuda, their torch twins elsewhere."""
    if name != "auto":
        return name
    return "triton" if device_kind == "cuda" else "torch"


def resolve(config: EngineConfig, gpu: bool | None = None) -> dict[str, str]:
    """{"device": "cpu" | "cuda", "dtype": ..., "backend": "torch" | "triton"} for an engine of
    ``config``. ``gpu``: whether the engine will see a GPU when ``device`` is ``auto`` (a Ray
    actor's, say); None asks torch in this process."""
    device = config.device
    if device == "auto":
        if gpu is None:
            import torch

            gpu = torch.cuda.is_available()
        device = "cuda" if gpu else "cpu"
    kind = device.split(":")[0]
    return {
        "device": kind,
        "dtype": dtype_name(config.dtype, kind),
        "backend": backend_name(config.backend, kind),
    }
