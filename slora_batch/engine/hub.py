"""Models and adapters named as on the Hugging Face Hub (``org/name``, ``org/name@revision``),
resolved to a local snapshot directory through the Hugging Face cache (``huggingface_hub``'s own
files: ``HF_HOME``, ``HF_HUB_CACHE``).

Order, for each name: an existing local path always wins; else the cached snapshot
(``local_files_only``); else, unless ``HF_HUB_OFFLINE`` is set, a download of the files the
engine reads (``ALLOW_PATTERNS``); else the name is missing. ``locate`` resolves a model and its
adapters at once and names every name it cannot resolve in one ``HubError``, so a job fails
before any work. The environment is read at each call, not at import (``huggingface_hub`` reads
its constants once), so a process that sets ``HF_HUB_CACHE`` later is honoured.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

# What the engine reads of a model or adapter repository; nothing else is downloaded.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "adapter_config.json",
    "adapter_model.safetensors",
]
_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]+://")
_TRUE = {"1", "on", "yes", "true"}


class HubError(ValueError):
    """Names that are neither local directories nor resolvable on the Hub; the message names
    every one (model and adapters), the revision asked and what to do."""


@dataclass(frozen=True)
class Snapshot:
    """A Hub name resolved: ``path`` is ``snapshots/<commit>`` in the cache."""

    name: str  # as written: "org/name" or "org/name@rev"
    repo_id: str
    revision: str | None  # as asked; None: the default branch
    commit: str  # the snapshot's commit hash
    path: Path


@dataclass
class Located:
    """A model and adapters with every Hub name replaced by its snapshot directory."""

    model: str | Path
    adapters: str | Path | dict[str, str | Path] | None
    snapshots: dict[str, Snapshot] = field(default_factory=dict)  # "model" / "adapter 'x'"


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as the environment says now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def cache_dir() -> Path:
    """The Hub cache as the environment says now: ``HF_HUB_CACHE``, else the legacy
    ``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub`` (``$XDG_CACHE_HOME/huggingface/hub``)."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(key):
            return Path(os.path.expandvars(os.environ[key])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_candidate(text: str | os.PathLike) -> bool:
    """Whether ``text`` is to be read as a Hub name: a string with a "/" that is no existing
    path, no URI, and starts with neither "/", "." nor "~"."""
    if not isinstance(text, str) or "/" not in text or _URI.match(text):
        return False
    return not text.startswith(("/", ".", "~", "\\")) and not Path(text).exists()


def parse_name(text: str) -> tuple[str, str | None]:
    """``org/name[@revision]`` -> (repo id, revision or None); ``ValueError`` saying why a
    malformed one is not a Hub name."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id, at, revision = text.partition("@")
    if at and not revision:
        raise ValueError("an empty revision after '@'")
    if repo_id.count("/") != 1:
        raise ValueError("a Hub name is org/name or org/name@revision")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ValueError(str(exc)) from exc
    return repo_id, (revision or None)


def snapshot(name: str) -> Snapshot:
    """The local snapshot of Hub name ``name``: cached, else downloaded when the network is
    allowed. ``ValueError`` (malformed) or ``LookupError`` (not found, with why)."""
    from huggingface_hub import snapshot_download

    repo_id, revision = parse_name(name)
    kwargs = dict(revision=revision, cache_dir=str(cache_dir()), allow_patterns=ALLOW_PATTERNS)
    try:
        path = snapshot_download(repo_id, local_files_only=True, **kwargs)
    except Exception as cached_miss:  # LocalEntryNotFoundError, IncompleteSnapshotError
        if offline():
            raise LookupError(f"not in the cache {cache_dir()}") from cached_miss
        log.info("downloading %s from the Hugging Face Hub into %s", name, cache_dir())
        try:
            path = snapshot_download(repo_id, **kwargs)
        except Exception as exc:  # connection, 404, gated, revision not found: all say "missing"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise LookupError(f"download failed: {type(exc).__name__}: {first}") from exc
    path = Path(path)
    log.info("%s resolved to %s", name, path)
    return Snapshot(name=name, repo_id=repo_id, revision=revision, commit=path.name, path=path)


def locate(model: str | Path, adapters: str | Path | Mapping[str, str | Path] | None) -> Located:
    """``model`` and the adapter mapping's paths with every Hub name resolved (``snapshot``);
    local paths, the sample alias and a directory of adapters stay as given. ``HubError``
    names every name that cannot be resolved, all at once."""
    found: dict[str, Snapshot] = {}
    missing: list[tuple[str, str, str]] = []  # (label, name, why)
    wanted = [("model", model)]
    if isinstance(adapters, Mapping):
        wanted += [(f"adapter {key!r}", value) for key, value in adapters.items()]
    for label, value in wanted:
        if not hub_candidate(value):
            continue
        try:
            found[label] = snapshot(value)
        except (ValueError, LookupError) as exc:
            missing.append((label, value, str(exc)))
    if missing:
        raise HubError(_missing_message(missing))
    if isinstance(adapters, Mapping):
        adapters = {
            k: found[f"adapter {k!r}"].path if f"adapter {k!r}" in found else v
            for k, v in adapters.items()
        }
    return Located(found["model"].path if "model" in found else model, adapters, found)


def _missing_message(missing: list[tuple[str, str, str]]) -> str:
    """One sentence naming every missing name with its revision and why, and the commands
    that fetch them."""
    what, hints = [], []
    for label, name, why in missing:
        try:
            repo_id, revision = parse_name(name)
        except ValueError:
            what.append(f"{label} {name!r} is no directory and no Hub name ({why})")
            continue
        what.append(f"{label} {name!r} (revision {revision or 'main'}: {why})")
        hints.append(
            f"huggingface-cli download {repo_id}" + (f" --revision {revision}" if revision else "")
        )
    hint = f"; fetch with `{'`, `'.join(hints)}`" if hints else ""
    if hints and offline():
        hint += " where the network is on, or unset HF_HUB_OFFLINE to let slora-batch download"
    n = len(missing)
    return (
        f"{n} name{'s' if n > 1 else ''} not found locally nor on the Hugging Face Hub: "
        f"{'; '.join(what)}{hint}"
    )
