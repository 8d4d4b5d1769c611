"""The header of the bench's results (run.json, and the top of results.md): date, card, commit,
library versions, the two rates measured on the card, every setting."""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

COMMIT_ENV = "SLORA_BATCH_COMMIT"  # where the tree travels without .git (the device machine)


def run_meta(
    device: torch.device, dtype: torch.dtype, rates, config, model, ranks: list[int]
) -> dict:
    """The results header: date, card, commit, versions, the two measured rates, the settings;
    ``ranks``: the adapters' weight sets, one per rank."""
    if device.type == "cuda":
        card = torch.cuda.get_device_name(device)
    else:
        card = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    settings = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(config).items()
    }
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "card": card,
        "commit": _commit(),
        "versions": {name: _version(name) for name in ("torch", "triton", "transformers", "peft")},
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": model.num_params,
        "active_parameters": model.active_params,
        "matmul_tflops": rates.matmul_flops_per_s / 1e12,
        "copy_tb_per_s": rates.copy_bytes_per_s / 1e12,
        "adapter_weight_sets": len(ranks),
        "adapter_ranks": ranks,
        "settings": settings,
        "skipped": [],
    }


def _commit() -> str:
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return f"unknown (no git; set {COMMIT_ENV})"
    return head + (" + uncommitted changes" if dirty else "")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"
