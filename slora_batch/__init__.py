"""slora-batch: offline batch inference of one base LLM with thousands of LoRA adapters.

Three packages follow the data flow, job -> rows -> windows -> engine -> writer:
``slora_batch.engine`` (one base model, many adapters: requests in, results out),
``slora_batch.jobs`` (the offline job tool around it) and ``slora_batch.bench`` (the benchmark).
``Engine`` (and ``DeviceMemoryError``, raised by one that does not fit on its device) is
imported on first use: the settings and request types need no torch.
"""

from slora_batch.engine.config import EngineConfig, SamplingConfig
from slora_batch.engine.requests.request import Request, Result

__version__ = "0.1.0"  # pyproject.toml reads it from here
__all__ = [
    "DeviceMemoryError",
    "Engine",
    "EngineConfig",
    "Request",
    "Result",
    "SamplingConfig",
    "__version__",
]


def __getattr__(name: str):
    if name == "Engine":
        from slora_batch.engine.engine import Engine

        return Engine
    if name == "DeviceMemoryError":
        from slora_batch.engine.execution.memory import DeviceMemoryError

        return DeviceMemoryError
    raise AttributeError(f"module 'slora_batch' has no attribute {name!r}")
