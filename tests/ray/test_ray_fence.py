"""Ray part names and the run fence (``slora_batch/ray/fence.py``), on plain files (no Ray): names
cannot collide, an orphaned actor's late part is removed by itself, by the driver at the end and
by the next run; temp names of two hosts' processes with the same pid differ."""

from __future__ import annotations

import itertools
import json
import socket

import pytest

from slora_batch.jobs import outdir
from slora_batch.jobs.outdir import PART_RE, commit_file
from slora_batch.ray.fence import (
    FENCE_FILE,
    fenced_out,
    open_run,
    part_name,
    part_run,
    read_fence,
    remove_late_parts,
    still_ours,
    unit_key,
)


def test_unit_keys_and_part_names_never_collide():
    grid = itertools.product((0, 1, 7, 999_999), (0, 1, 10, 10**12 - 1), (0, 1, 31, 999_999))
    keys = [unit_key(*position) for position in grid]
    assert len(set(keys)) == len(keys) and {len(k) for k in keys} == {24}
    names = [part_name(run, key) for run in (1, 2) for key in keys]
    assert len(set(names)) == len(names) and all(PART_RE.match(n) for n in names)
    assert [part_run(n) for n in names[:2]] == [1, 1] and part_run(names[-1]) == 2
    assert part_run("part-00003.parquet") is None  # the single-process tool's parts
    with pytest.raises(ValueError, match="adapter bucket 1000000"):
        unit_key(0, 0, 10**6)


def commit_part(out, name: str) -> None:
    (out / name).write_bytes(b"rows")


def test_late_parts_of_an_orphaned_actor_are_removed_and_none_of_the_accepted(tmp_path):
    out = tmp_path
    single = "part-00000.parquet"
    commit_part(out, single)
    run1, _ = open_run(out)
    ours = part_name(run1, unit_key(0, 0, 0))
    commit_part(out, ours)
    assert still_ours(out, run1, ours)  # no later run: kept

    # the driver of run 1 is killed; its actor is not. Run 2 starts and fences it off.
    run2, accepted = open_run(out)
    assert run2 == run1 + 1 and accepted == {single, ours} and fenced_out(out, run1)
    late = part_name(run1, unit_key(0, 1, 0))
    commit_part(out, late)
    assert not still_ours(out, run1, late) and not (out / late).exists()

    # a late part that slipped in before the fence was written: the driver removes it at the end
    slipped = part_name(run1, unit_key(0, 2, 0))
    commit_part(out, slipped)
    new = part_name(run2, unit_key(0, 2, 0))
    commit_part(out, new)
    assert remove_late_parts(out, read_fence(out)) == [slipped]
    assert {p.name for p in out.glob("part-*")} == {single, ours, new}

    # run 2 is killed too; an orphan of run 1 commits again; run 3 removes it before reading
    commit_part(out, slipped)
    run3, accepted = open_run(out)
    assert run3 == run2 + 1 and accepted == {single, ours, new}
    assert json.loads((out / FENCE_FILE).read_text())["run"] == run3


def test_temp_names_differ_between_hosts_with_the_same_pid(tmp_path, monkeypatch):
    temps = []
    monkeypatch.setattr(outdir.os, "getpid", lambda: 4242)
    for host in ("node-a", "node-b"):
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        commit_file(tmp_path / "part-00001.parquet", lambda handle: temps.append(handle.name))
    assert len(set(temps)) == 2 and all(outdir.TMP_MARK in t for t in temps)
