"""Input files and output directories on a filesystem other than the local disk (``s3://``,
``gs://``, any ``pyarrow.fs`` filesystem): the seam the Ray job runner reads and writes through.

Everywhere in the job tool, ``fs=None`` (and an output given as a ``str``/``Path``) means the
local disk and the code paths of the single-process tool, unchanged: ``os``/``open`` calls,
temp-then-rename commits, ``flock``. A ``FsDir`` is an output directory on another filesystem;
an input file there is a ``Path`` of its path on that filesystem plus the filesystem passed
alongside (``fs``). Object stores name objects "bucket/key", without a leading "/", so paths are
compared as written, never made absolute against this process's working directory.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

EDGE_BYTES = 1 << 20  # a file's content digest covers its size and its first and last MiB


def open_fs(
    path: str, filesystem: pafs.FileSystem | None = None
) -> tuple[pafs.FileSystem | None, str]:
    """(filesystem, path on it) of a local path or a URI; the filesystem is None for the local
    disk (a plain path or ``file://``). ``filesystem`` given: ``path`` is a path on it."""
    if filesystem is not None:
        return filesystem, path
    if "://" not in path:
        return None, os.path.abspath(path)
    fs, inner = pafs.FileSystem.from_uri(path)
    if isinstance(fs, pafs.LocalFileSystem):
        return None, inner
    return fs, inner


def file_info(fs: pafs.FileSystem, path: str) -> pafs.FileInfo:
    return fs.get_file_info(str(path))


def stat(fs: pafs.FileSystem | None, path: str | Path) -> list[int | str | None]:
    """[size, mtime in ns, content digest] as the manifest keeps them, of a file on ``fs`` (None:
    the local disk); mtime is None where the filesystem gives none (fsspec's memory
    filesystem): then size and digest tell a change."""
    if fs is None:
        local = os.stat(path)
        with open(path, "rb") as handle:
            return [local.st_size, local.st_mtime_ns, edge_digest(handle, local.st_size)]
    path = str(path)
    info = file_info(fs, path)
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(f"{path}: no such file")
    with fs.open_input_file(path) as handle:
        digest = edge_digest(handle, info.size)
    return [info.size, info.mtime_ns, digest]


def dir_stats(path: str | Path) -> dict[str, list[int | str | None]]:
    """``stat`` of a local file, or of every visible file directly in a local directory, by
    name; {} when there is neither."""
    path = Path(path)
    if path.is_file():
        return {path.name: stat(None, path)}
    if not path.is_dir():
        return {}
    return {
        p.name: stat(None, p)
        for p in sorted(path.iterdir())
        if p.is_file() and not p.name.startswith(".")
    }


def edge_digest(handle, size: int) -> str:
    """A digest of a file's size and its first and last ``EDGE_BYTES`` (the whole file when it
    is at most twice that): cheap on any size, and it tells a rewrite of the same size apart
    (a file of 2 GB is read 2 MiB). ``handle``: open for binary reading, seekable."""
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    digest.update(handle.read(EDGE_BYTES))
    if size > EDGE_BYTES:
        handle.seek(max(EDGE_BYTES, size - EDGE_BYTES))
        digest.update(handle.read(EDGE_BYTES))
    return digest.hexdigest()


def fully_digested(size: int) -> bool:
    """Whether ``edge_digest`` covers every byte of a file of ``size`` bytes."""
    return size <= 2 * EDGE_BYTES


def list_files(fs: pafs.FileSystem, spec: str) -> tuple[str, list[str]]:
    """("file", [spec]), ("dir", files directly in it) or ("glob", files matching it), the
    files sorted; ("missing", []) when the spec names nothing. A glob lists the folder before
    its first wildcard, recursively when the pattern has ``**`` (as ``glob.glob`` does)."""
    kind = file_info(fs, spec).type
    if kind == pafs.FileType.File:
        return "file", [spec]
    if kind == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(spec, recursive=False))
        return "dir", sorted(i.path for i in infos if i.type == pafs.FileType.File)
    if not glob.has_magic(spec):
        return "missing", []
    parts = spec.split("/")
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    base = "/".join(parts[:fixed]) or "/"
    selector = pafs.FileSelector(base, recursive="**" in spec, allow_not_found=True)
    pattern = spec.replace("**/", "*").replace("**", "*")  # fnmatch's "*" crosses "/" already
    infos = fs.get_file_info(selector)
    found = [i.path for i in infos if i.type == pafs.FileType.File]
    if "**" not in spec:  # "*" stops at "/" in glob: the file must sit at the pattern's depth
        found = [p for p in found if p.count("/") == spec.count("/")]
    return "glob", sorted(p for p in found if fnmatch.fnmatchcase(p, pattern))


def common_folder(paths: list[str]) -> str:
    """The folder that holds every path, compared as written (no working directory)."""
    return posixpath.commonpath([posixpath.dirname(p) for p in paths])


@dataclass(frozen=True)
class FsDir:
    """An output directory on a non-local ``pyarrow.fs`` filesystem (picklable: Ray actors get
    it). Files are committed by writing the final name in one ``open_output_stream``: on object
    stores (S3, GCS, Azure) an upload stores the whole object or none of it, and readers see the
    previous object until it completes, so no temp name and no rename (which object stores do
    not have) are needed. On other filesystems (HDFS, fsspec wrappers) a writer killed mid-write
    may leave a partial file, which the next run reports as an unreadable part."""

    fs: pafs.FileSystem
    path: str

    def __str__(self) -> str:
        return f"{self.fs.type_name}:{self.path}"

    def child(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"

    def names(self) -> list[str]:
        """The names of the files directly in the directory; [] when it does not exist."""
        selector = pafs.FileSelector(self.path, recursive=False, allow_not_found=True)
        infos = self.fs.get_file_info(selector)
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)

    def exists(self, name: str) -> bool:
        return file_info(self.fs, self.child(name)).type == pafs.FileType.File

    def is_file_or_missing(self) -> bool:
        """False when the directory's path names a file."""
        return file_info(self.fs, self.path).type != pafs.FileType.File

    def read(self, name: str) -> bytes | None:
        """The file's bytes, or None when there is none."""
        if not self.exists(name):
            return None
        with self.fs.open_input_stream(self.child(name)) as handle:
            return handle.read()

    def commit(self, name: str, write: Callable[[Any], Any]) -> None:
        """Write file ``name`` in one upload (see the class docstring for why that is atomic)."""
        self.fs.create_dir(self.path, recursive=True)
        with self.fs.open_output_stream(self.child(name)) as handle:
            write(handle)

    def remove(self, name: str) -> None:
        if self.exists(name):
            self.fs.delete_file(self.child(name))
