"""Part names of the Ray runner and the fence between its runs.

A Ray part is ``part-<run, 6 digits><unit, 24 digits>.parquet``: the run's number and the unit's
key (input file index 6 digits, block index 12, adapter bucket 6), e.g. run 3, file 0, block 4,
bucket 2 of 8 -> ``part-000003000000000000000004000002.parquet``. Within a run two units never
share a name (the key is their position, not a hash); a retry of a unit rewrites its own name.

The fence (``_ray_run.json``: ``{"run": 3, "parts": [names]}``) is written when a run starts: the
parts present then are the run's accepted parts, the only ones its resume reads. An actor of an
earlier run (its driver killed, the actor not yet) may still commit a part afterwards; that part
is not accepted and not of the current run, so it is removed: by the actor itself, which reads
the fence after each commit, by the driver when the run ends, and by the next run when it starts
(before it lists what is done). Rows of a removed part were pending for the run that removed it,
so it writes them itself: no row is lost and none is there twice.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from slora_batch.jobs.fsio import FsDir
from slora_batch.jobs.outdir import commit, part_files, remove_file

logger = logging.getLogger(__name__)

FENCE_FILE = "_ray_run.json"
RUN_DIGITS, FILE_DIGITS, BLOCK_DIGITS, BUCKET_DIGITS = 6, 6, 12, 6
RAY_PART_RE = re.compile(
    rf"^part-(\d{{{RUN_DIGITS}}})(\d{{{FILE_DIGITS + BLOCK_DIGITS + BUCKET_DIGITS}}})\.parquet$"
)


def unit_key(file_index: int, block: int, bucket: int) -> str:
    """A unit's key: its input file's index, block index and adapter bucket, fixed width."""
    for name, value, digits in (
        ("input file index", file_index, FILE_DIGITS),
        ("block index", block, BLOCK_DIGITS),
        ("adapter bucket", bucket, BUCKET_DIGITS),
    ):
        if not 0 <= value < 10**digits:
            raise ValueError(f"{name} {value} does not fit the part name's {digits} digits")
    return f"{file_index:0{FILE_DIGITS}d}{block:0{BLOCK_DIGITS}d}{bucket:0{BUCKET_DIGITS}d}"


def part_name(run: int, unit: str) -> str:
    return f"part-{run:0{RUN_DIGITS}d}{unit}.parquet"


def part_run(name: str) -> int | None:
    """The run a Ray part was committed by; None for other parts (the single-process tool's)."""
    match = RAY_PART_RE.match(name)
    return int(match.group(1)) if match else None


def read_fence(out: Path | FsDir) -> dict | None:
    if isinstance(out, FsDir):
        data = out.read(FENCE_FILE)
    else:
        path = out / FENCE_FILE
        data = path.read_bytes() if path.is_file() else None
    return None if data is None else json.loads(data)


def _names(out: Path | FsDir) -> list[str]:
    return [path.name for _, path in part_files(out)]


def remove_late_parts(out: Path | FsDir, fence: dict | None) -> list[str]:
    """Remove the Ray parts committed after ``fence`` was written by runs other than its own."""
    if fence is None:
        return []
    accepted = set(fence["parts"])
    late = [
        name
        for name in _names(out)
        if part_run(name) not in (None, fence["run"]) and name not in accepted
    ]
    for name in late:
        logger.warning(
            "%s: removing %s, committed by an actor of run %d after run %d started",
            out,
            name,
            part_run(name),
            fence["run"],
        )
        remove_file(out, name)
    return late


def open_run(out: Path | FsDir) -> tuple[int, set[str]]:
    """Start a run: remove the previous run's late parts, write the fence; the run's number
    and its accepted parts (those its resume may read)."""
    previous = read_fence(out)
    remove_late_parts(out, previous)
    names = _names(out)
    runs = [part_run(n) or 0 for n in names] + [previous["run"] if previous else 0]
    run = max(runs) + 1
    if run >= 10**RUN_DIGITS:
        raise ValueError(f"{out}: run number {run} does not fit the part name's digits")
    text = json.dumps({"run": run, "parts": names}).encode() + b"\n"
    commit(out, FENCE_FILE, lambda handle: handle.write(text))
    return run, set(names)


def still_ours(out: Path | FsDir, run: int, name: str) -> bool:
    """After an actor of ``run`` committed ``name``: keep it (True), or remove it when a later
    run has started without accepting it (False)."""
    fence = read_fence(out)
    if fence is None or fence["run"] == run or name in fence["parts"]:
        return True
    logger.warning(
        "%s: run %d started after run %d's part %s; removing it", out, fence["run"], run, name
    )
    remove_file(out, name)
    return False


def fenced_out(out: Path | FsDir, run: int) -> bool:
    """Whether a later run has started: an actor of ``run`` then stops generating."""
    fence = read_fence(out)
    return fence is not None and fence["run"] != run
