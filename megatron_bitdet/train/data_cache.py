"""Crash- and race-safe cache directories: an advisory file lock, atomic publish, and a
content manifest (size + xxh3_128 per file) that tells a complete cache from a torn or corrupt one.

The lock is ``fcntl.flock``: it serializes cooperating processes on one machine (and on shared
filesystems whose flock is coherent, e.g. Lustre/GPFS; not all NFS setups are).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path

import xxhash

_CHUNK = 1 << 22


@contextlib.contextmanager
def file_lock(path: Path):
    """Hold an exclusive lock on ``path`` (created if missing) for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return "xxh3_128:" + h.hexdigest()


def files_manifest(directory: Path, names) -> dict[str, list]:
    """``{name: [size, digest]}`` for the given files of ``directory``."""
    return {n: [(directory / n).stat().st_size, file_digest(directory / n)] for n in sorted(names)}


def manifest_matches(directory: Path, manifest: dict) -> bool:
    """True when every listed file exists with the recorded size and digest."""
    try:
        return all(
            (directory / n).stat().st_size == size and file_digest(directory / n) == digest
            for n, (size, digest) in manifest.items()
        )
    except (OSError, TypeError, ValueError):
        return False


def read_json(path: Path) -> dict | None:
    """The JSON object at ``path``, or None when it is missing or unreadable (a torn write)."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def publish_dir(tmp: Path, final: Path) -> None:
    """Move a fully written ``tmp`` directory to ``final``, replacing a stale one (caller holds the lock).

    Readers that already mmap files of the old directory keep valid (unlinked) inodes.
    """
    if final.exists():
        stale = final.with_name(f".stale-{final.name}-{os.getpid()}")
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(tmp, final)
