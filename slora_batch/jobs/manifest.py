"""The job manifest (``_job.json``): what an output's rows were produced from. A job's first run
writes it with the ``fingerprint`` (input files with sizes, mtimes and content digests, model and
adapter files, the repository and snapshot commit each Hub name resolved to, sampling, the
job keys that decide rows, and the device kind, dtype and kernel backend the engine settings
resolve to), the input scan and the input columns it reads
(``reads``); every later run compares them and refuses a directory that holds rows of other
inputs or settings, naming what changed.

A file whose size and digest are the same is the same file when the digest covers all of it (up
to 2 MiB: a touched input is not a change); a larger one whose mtime moved is refused, since
its middle was not compared. A manifest of an earlier version lacks the digests and the
resolution: its files are compared by size and mtime, its raw ``dtype`` as written, and a
resume that finds nothing changed records both from then on.

A later version may read more columns (the scoring columns, ``logprobs``): an output whose input
has such a column was made without it, so it is refused too; one whose input has none stays
valid. A manifest without ``reads`` was written before the scoring columns existed
(``FIRST_READS``, ``FIRST_OPTIONS``).

``output_columns`` records the output's own columns the job's parts hold, decided on its first
run from the input scan (``scan_columns``), so every part of an output has one schema
(``output_schema``); a manifest without it is an earlier version's, whose parts hold
``schema.LEGACY_COLUMNS``."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from slora_batch.engine.adapters.adapter_files import resolve_sources
from slora_batch.engine.config import SamplingConfig
from slora_batch.engine.resolution import resolve
from slora_batch.jobs import fsio
from slora_batch.jobs.check import JobError, JobPlan, check_scan
from slora_batch.jobs.config import SCORE_KEYS, prompt_keys
from slora_batch.jobs.fsio import FsDir
from slora_batch.jobs.openai_input import kept_columns
from slora_batch.jobs.outdir import (
    MANIFEST_FILE,
    SUCCESS_FILE,
    part_files,
    read_manifest,
    read_success,
    remove_file,
    write_manifest,
)
from slora_batch.jobs.reader import input_root, relative_name, used_columns
from slora_batch.jobs.scan import InputScan, limit_changed, scan_input
from slora_batch.jobs.schema import LEGACY_COLUMNS, OUTPUT_COLUMNS, job_columns, part_schema

logger = logging.getLogger(__name__)

MANIFEST_VERSION = 1
CHANGES_SHOWN = 6  # fingerprint differences named in a refusal
# What the versions whose manifests have no "reads" read: these column keys (as the job's
# ``columns`` maps them) and these per-row options. Frozen: a later option is not among them.
FIRST_READS = ("id", "adapter", "prompt", "messages", "prompt_token_ids")
FIRST_OPTIONS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")


def run_manifest(
    out: Path | FsDir,
    name: str,
    columns: dict[str, str],
    current: dict[str, Any],
    limit: int | None,
) -> tuple[dict[str, Any], InputScan, bool] | None:
    """The manifest a run of job ``name`` resumes under (``resumable_manifest``'s), its input
    scan, and whether the output is complete under it (its ``_SUCCESS`` marker written); None
    for a first run. A manifest whose scan was taken under another ``limit`` is a first run's
    too: its row counts and completion are of other rows, so the marker is removed first; the
    rows the output holds stay (a larger limit adds the new ones)."""
    manifest = resumable_manifest(out, name, columns, current)
    if manifest is None:
        return None
    scan = InputScan.from_json(manifest["scan"])
    if limit_changed(manifest, limit):
        logger.info("job %s: limit is %s now: scanning the input again", name, limit)
        remove_file(out, SUCCESS_FILE)
        return None
    if manifest["fingerprint"] != current:
        manifest = {**manifest, "fingerprint": current}  # an earlier version's, a touched input
        write_manifest(out, manifest)
    return manifest, scan, read_success(out) is not None


def first_manifest(
    plan: JobPlan, out: Path | FsDir, current: dict[str, Any]
) -> tuple[dict[str, Any], InputScan]:
    """The manifest of the output's first run, written, and its input scan (``scan_for_run``)."""
    job = plan.job
    scan = scan_for_run(plan)
    manifest = new_manifest(job.name, job.columns, current, scan)
    write_manifest(out, manifest)
    return manifest, scan


def scan_for_run(plan: JobPlan) -> InputScan:
    """The job's input scan (on the input's filesystem); duplicate rows fail the job."""
    job = plan.job
    files = len(plan.files)
    logger.info("job %s: scanning %d input file%s", job.name, files, "" if files == 1 else "s")
    scan = scan_input(
        plan.files,
        job.columns,
        kept_columns(job.keep_columns, plan.openai),
        plan.sweep is not None,
        reserved=OUTPUT_COLUMNS,
        fs=plan.input_fs,
        openai=plan.openai,
        fields=plan.prompts.fields,
        limit=job.limit,
    )
    check_scan(plan, scan, "; nothing was run")  # duplicates, a template's missing column
    return scan


def new_manifest(
    name: str, columns: dict[str, str], current: dict[str, Any], scan: InputScan
) -> dict[str, Any]:
    """The manifest of job ``name``'s first run: its fingerprint ``current``, its input scan,
    the input columns it reads (by its ``columns`` mapping) and the output's own columns its
    parts hold (``scan_columns``)."""
    output_columns = scan_columns(columns, scan)
    return {
        "version": MANIFEST_VERSION,
        "job": name,
        "fingerprint": current,
        "scan": scan.to_json(),
        "reads": used_columns(columns),
        "output_columns": output_columns,
    }


def scan_columns(columns: dict[str, str], scan: InputScan) -> list[str]:
    """The output's own columns of a job over the input ``scan`` found: the scoring columns
    when the input has a scoring column (named by the job's ``columns`` mapping), ``logprobs``
    when it has a ``logprobs`` column (an OpenAI Batch body asking for them included); the core
    columns always."""
    found = set(scan.columns_found)
    scoring = any(columns.get(key, key) in found for key in SCORE_KEYS)
    return job_columns(scoring, "logprobs" in found)


def output_columns(manifest: dict[str, Any]) -> list[str]:
    """The output's own columns the manifest records; a manifest of an earlier version records
    none: its parts hold every column of that version (``LEGACY_COLUMNS``)."""
    return list(manifest.get("output_columns") or LEGACY_COLUMNS)


def output_schema(manifest: dict[str, Any]) -> pa.Schema:
    """The schema of the parts of the output the manifest describes: its id type, its own
    columns and the kept columns."""
    scan = InputScan.from_json(manifest["scan"])
    return part_schema(scan.id_type, scan.keep, scan.json_text, output_columns(manifest))


def resumable_manifest(
    out: Path | FsDir, name: str, columns: dict[str, str], current: dict[str, Any]
) -> dict[str, Any] | None:
    """The manifest of output ``out`` when it describes job ``name`` (its ``columns`` mapping,
    its fingerprint ``current``) as it is now; None when there is none or it is stale but no
    row was committed under it. Refuses (``JobError``) an output that holds rows of other
    inputs or settings, or rows without a manifest."""
    manifest = read_manifest(out)
    has_rows = bool(part_files(out)) or read_success(out) is not None
    if manifest is None:
        if has_rows:
            raise JobError(
                f"job {name!r}: output {str(out)!r} holds parts but no {MANIFEST_FILE}, so "
                "what produced them is unknown (an older slora-batch or another tool); nothing "
                "was run. Re-run with --overwrite to start over, or give the job another output"
            )
        return None
    if manifest.get("version") != MANIFEST_VERSION or "scan" not in manifest:
        changes = [f"manifest version {manifest.get('version')!r} -> {MANIFEST_VERSION}"]
    else:
        changes = fingerprint_changes(manifest.get("fingerprint") or {}, current)
        changes += column_changes(manifest, columns)
    if not changes:
        return manifest
    if not has_rows:
        logger.info("job %s: starting afresh (%s)", name, "; ".join(changes))
        return None
    shown = "; ".join(changes[:CHANGES_SHOWN])
    more = len(changes) - CHANGES_SHOWN
    raise JobError(
        f"job {name!r}: output {str(out)!r} holds rows made from other inputs or settings: "
        f"{shown}{f'; and {more} more' if more > 0 else ''}. Nothing was run; re-run with "
        "--overwrite to start over, or give the job another output"
    )


def fingerprint(plan: JobPlan, gpu: bool | None = None) -> dict[str, Any]:
    """What decides a job's rows, cheap to take (file sizes and mtimes, and a digest of each
    file's size and first and last MiB): the input files, the model's and every adapter's files,
    the sampling, the job keys that change outputs (columns, fanout, keep_columns,
    max_model_len, dtype) and what the engine settings resolve to (``resolution.resolve``;
    ``gpu``: whether the engines will see a GPU, None: this process's answer). JSON-ready."""
    job = plan.job
    sources = resolve_sources(plan.sources)
    model = plan.snapshots.get("model")  # a Hub name pinned to a revision is the same model
    model_name = model.repo_id if model is not None else job.model
    root = input_root(plan.files, plan.input_fs)
    input_stats = [fsio.stat(plan.input_fs, f) for f in plan.files]
    model_stats = fsio.dir_stats(plan.model_path)
    adapter_stats = {name: fsio.dir_stats(path) for name, path in sorted(sources.items())}
    taken = {
        "input": {relative_name(f, root): s for f, s in zip(plan.files, input_stats, strict=True)},
        "model": {"model": model_name, "files": model_stats},
        "adapters": adapter_stats,
        "sampling": dataclasses.asdict(job.sampling),
        "job": {
            # renamed columns only: a column key a later version adds (mapped to itself) must
            # not make every earlier output look stale
            "columns": {key: name for key, name in job.columns.items() if key != name},
            "fanout": job.fanout,
            "keep_columns": job.keep_columns,
            "max_model_len": job.engine.max_model_len,
            "dtype": job.engine.dtype,
            **prompt_keys(job),  # prompt_template & co when set: earlier outputs keep theirs
        },
        "engine": resolve(job.engine, gpu),
    }
    if plan.openai is not None:  # only then: outputs of rows inputs keep their fingerprint
        taken["job"]["input_format"] = "openai"
    if plan.snapshots:  # Hub names: the repository and the snapshot's commit each resolved to
        taken["hub"] = {
            label: {"name": snap.name, "repo": snap.repo_id, "commit": snap.commit}
            for label, snap in sorted(plan.snapshots.items())
        }
    return json.loads(json.dumps(taken))  # tuples -> lists, as read back from the manifest


def column_changes(manifest: dict[str, Any], columns: dict[str, str]) -> list[str]:
    """Input columns the manifest's rows were made without that this version reads (found in
    the input by the manifest's scan; named by the job's ``columns`` mapping), and kept columns
    whose names the output now has itself."""
    scan = manifest["scan"]
    read_then = manifest.get("reads")
    if read_then is None:
        read_then = [columns[key] for key in FIRST_READS] + list(FIRST_OPTIONS)
    present = {*scan.get("unused", {}), *scan.get("keep", {}), *scan.get("clashing", [])}
    # an answer acts only on a scored row, whose scoring column is checked itself: a reference
    # answer kept beside generated rows (GSM8K's "answer") changes none of them
    changes = [
        f"input column {name!r} is read now but was not when the rows were made"
        for name in used_columns(columns)
        if name not in read_then and name in present and name != columns["answer"]
    ]
    changes += [
        f"kept column {name!r} is now one of the output's own columns"
        for name in scan.get("keep", {})
        if name in OUTPUT_COLUMNS
    ]
    return changes


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, in words: "input rows.jsonl changed (size 10 ->
    12)", "sampling.max_new_tokens 8 -> 16", "adapter 'c' added", ..."""
    changes = _hub_changes(old.get("hub", {}), new.get("hub", {}))
    changes += _files_changes("input", old.get("input", {}), new["input"])
    old_model, new_model = old.get("model", {}), new["model"]
    if old_model.get("model") != new_model["model"]:
        changes.append(f"model {old_model.get('model')!r} -> {new_model['model']!r}")
    else:
        changes += _files_changes("model file", old_model.get("files", {}), new_model["files"])
    old_adapters, new_adapters = old.get("adapters", {}), new["adapters"]
    for name in sorted(set(old_adapters) | set(new_adapters)):
        if name not in new_adapters:
            changes.append(f"adapter {name!r} removed")
        elif name not in old_adapters:
            changes.append(f"adapter {name!r} added")
        else:
            changes += _files_changes(
                f"adapter {name!r} file", old_adapters[name], new_adapters[name]
            )
    # a sampling setting a later version adds, at its default, makes the rows it made before
    defaults = json.loads(json.dumps(dataclasses.asdict(SamplingConfig())))
    resolved = "engine" in old  # then the resolved dtype is compared, not the setting
    for section in ("sampling", "job"):
        before, after = old.get(section, {}), new[section]
        prefix = "sampling." if section == "sampling" else ""
        missing = defaults if section == "sampling" else {}
        for key in sorted(set(before) | set(after)):
            if section == "job" and key == "dtype" and resolved:
                continue
            if before.get(key, missing.get(key)) != after.get(key):
                changes.append(f"{prefix}{key} {before.get(key)!r} -> {after.get(key)!r}")
    if resolved:
        changes += _engine_changes(old["engine"], new["engine"])
    return changes


def _hub_changes(old: dict[str, dict], new: dict[str, dict]) -> list[str]:
    """Hub names resolved to another repository or snapshot than when the rows were made:
    "model 'org/m' resolves to snapshot 1a2b... now, the rows were made from 9f8e... (pin it
    with org/m@9f8e...)"."""
    changes = []
    for label in sorted(set(old) & set(new)):
        before, after = old[label], new[label]
        if before.get("repo") != after["repo"]:
            changes.append(f"{label} Hub repository {before.get('repo')} -> {after['repo']}")
        elif before.get("commit") != after["commit"]:
            changes.append(
                f"{label} {after['name']!r} resolves to snapshot {after['commit']} now, the rows "
                f"were made from {before.get('commit')} (pin it with "
                f"{after['repo']}@{before.get('commit')})"
            )
    return changes


def _engine_changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """What the rows were made with against what this run would make them with, in words:
    "engine.dtype resolved float32 on cpu -> bfloat16 on cuda", "engine.backend resolved torch
    -> triton"."""
    changes = []
    for key in ("device", "dtype", "backend"):
        if old.get(key) == new[key]:
            continue
        if key == "dtype":
            changes.append(
                f"engine.dtype resolved {old.get(key)} on {old.get('device')} -> "
                f"{new[key]} on {new['device']}"
            )
        else:
            changes.append(f"engine.{key} resolved {old.get(key)} -> {new[key]}")
    return changes


def _files_changes(what: str, old: dict[str, list], new: dict[str, list]) -> list[str]:
    changes = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            changes.append(f"{what} {name} removed")
        elif name not in old:
            changes.append(f"{what} {name} added")
        else:
            change = _file_change(old[name], new[name])
            if change:
                changes.append(f"{what} {name} changed ({change})")
    return changes


def _file_change(old: list, new: list) -> str | None:
    """Why a file of stat ``old`` ([size, mtime, digest]; an earlier version's has no digest)
    is not the file of stat ``new``, or None when it is: the same size and digest, and the same
    mtime unless the digest covers the whole file (then a touch is no change)."""
    size, mtime, digest = new
    if old[0] != size:
        return f"size {old[0]:,} -> {size:,} bytes"
    known = old[2] if len(old) > 2 else None
    if known is not None and known != digest:
        return f"content differs, same size {size:,} bytes"
    if old[1] == mtime or (known is not None and fsio.fully_digested(size)):
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime / 1e9))
    if known is None:
        return f"modified {when}"
    return f"modified {when}; its first and last MiB are the same, the rest was not compared"
