"""One run per output directory: ``OutputLock`` holds an ``flock`` on ``LOCK_FILE`` while a run
writes (the kernel drops it when the process dies); ``output_lock`` takes it for an output on
the local disk, and nothing elsewhere."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from slora_batch.jobs.fsio import FsDir
from slora_batch.jobs.outdir import LOCK_FILE, OutputError

logger = logging.getLogger(__name__)


class OutputLock:
    """An exclusive, non-blocking ``flock`` on ``out_dir/LOCK_FILE`` (the directory is created).

    A second holder, in this process or another, gets ``OutputError`` naming the pid that holds
    it. ``release`` removes the file while still holding the lock; a process that opened the old
    file meanwhile sees that the path no longer names what it locked and tries again, so two
    runs never both hold the directory. A killed process leaves the file, unlocked (the kernel
    drops an flock with its last descriptor), and the next run takes it.

    As a context, a directory the lock made that holds nothing when the context fails (a job
    refused before any work) is removed after the lock file.
    """

    ATTEMPTS = 5  # a lock file removed under us this many times in a row: give up

    def __init__(self, out_dir: str | Path) -> None:
        import fcntl  # POSIX only, like the atomic renames the writer relies on

        self.path = Path(os.path.abspath(out_dir)) / LOCK_FILE  # abspath: "a/../b" reads "b"
        self.made_dir = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(self.ATTEMPTS):
            handle = open(self.path, "a+")  # noqa: SIM115 -- held until release()
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "?"
                handle.close()
                raise OutputError(
                    f"output directory {str(self.path.parent)!r} is in use by another run "
                    f"(pid {holder}, lock file {self.path.name}); wait for it or stop it"
                ) from None
            if _same_file(self.path, handle):
                break
            handle.close()  # released and removed by its holder after we opened it
        else:
            raise OutputError(
                f"{self.path}: the lock file keeps being removed; is another run starting?"
            )
        self._handle = handle
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()

    def release(self) -> None:
        if not self._handle.closed:
            if _same_file(self.path, self._handle):
                self.path.unlink()  # still locked: nobody can take the file in between
            self._handle.close()  # closing the last descriptor drops the flock

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self.release()
        if exc_type is not None and self.made_dir:
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()  # fails on a directory that holds anything


def _same_file(path: Path, handle) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False


_warned_unlocked: set[str] = set()


def output_lock(out: Path | FsDir) -> OutputLock | contextlib.nullcontext:
    """The output's ``OutputLock`` on the local disk. Other filesystems have no ``flock`` and
    object stores no atomic create-if-absent, so nothing is locked there: a second run on the
    same output would write the same part names beside the first (logged once per output)."""
    if isinstance(out, Path):
        return OutputLock(out)
    if str(out) not in _warned_unlocked:
        _warned_unlocked.add(str(out))
        logger.warning(
            "output %s is not on the local disk and is not locked: run one job at a time on it",
            out,
        )
    return contextlib.nullcontext()
