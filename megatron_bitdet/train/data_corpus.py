"""A real text corpus that ships offline, turned into a megatron indexed dataset (.bin/.idx) once.

``python-stdlib`` is the Python standard library's own ``.py`` sources (tests and site-packages
skipped), read in sorted relative-path order so every machine with the same Python reads the same
bytes. A path to a text file or a directory of ``.txt``/``.py`` files works too. The corpus digest
(xxh3_128 over names and bytes, in order) names the cache directory: equal digest, equal data.
"""
from __future__ import annotations

import logging
import os
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch
import xxhash
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.train.data_cache import (
    files_manifest,
    manifest_matches,
    publish_dir,
    read_json,
    write_json_atomic,
)
from megatron_bitdet.train.data_tokenizer import EOD, ByteTokenizer

log = logging.getLogger(__name__)

STDLIB = "python-stdlib"
FORMAT = 1  # bump when the on-disk layout or the tokenization changes
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_DIR_SKIP = {"__pycache__"}
PREFIX = "corpus"  # <dir>/corpus.bin, <dir>/corpus.idx


@dataclass(frozen=True)
class Corpus:
    """Documents (relative name, bytes) in their fixed order, capped at ``max_bytes`` in total."""

    source: str
    documents: tuple[tuple[str, bytes], ...]
    digest: str

    @property
    def num_bytes(self) -> int:
        return sum(len(d) for _, d in self.documents)


def _walk(root: Path, suffixes: tuple[str, ...], skip: set[str]) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        rel = Path(dirpath).relative_to(root)
        found += [(rel / f).as_posix() for f in filenames if f.endswith(suffixes)]
    return sorted(found)


def _sources(spec: str) -> tuple[Path, list[str]]:
    if spec == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        return root, _walk(root, (".py",), _STDLIB_SKIP)
    path = Path(spec).expanduser()
    if path.is_file():
        return path.parent, [path.name]
    if path.is_dir():
        return path, _walk(path, (".py", ".txt"), _DIR_SKIP)
    raise BitdetInputError(f"data.corpus: {spec!r} is neither {STDLIB!r} nor an existing file or directory")


def read_corpus(spec: str, max_bytes: int) -> Corpus:
    """Read the corpus; the document that crosses ``max_bytes`` is truncated there, later ones dropped."""
    if max_bytes <= 0:
        raise BitdetInputError(f"data.max_bytes must be positive, got {max_bytes}")
    root, names = _sources(spec)
    docs, total = [], 0
    h = xxhash.xxh3_128(f"bitdet-corpus-v{FORMAT}\0".encode())
    for name in names:
        if total >= max_bytes:
            break
        data = (root / name).read_bytes()[: max_bytes - total]
        if not data:
            continue
        if bytes([EOD]) in data:
            raise BitdetInputError(
                f"data.corpus: {root / name} contains a NUL byte; byte 0 is the end-of-document token"
            )
        encoded = name.encode("utf-8", "surrogateescape")
        for part in (encoded, data):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        docs.append((name, data))
        total += len(data)
    if not docs:
        raise BitdetInputError(f"data.corpus: {spec!r} holds no non-empty .py/.txt files")
    return Corpus(source=spec, documents=tuple(docs), digest=h.hexdigest())


def _write_indexed(corpus: Corpus, directory: Path) -> None:
    tokenizer = ByteTokenizer()
    builder = IndexedDatasetBuilder(str(directory / f"{PREFIX}.bin"), dtype=numpy.uint8)
    for _, data in corpus.documents:
        tokens = numpy.append(tokenizer.tokenize(data), numpy.uint8(EOD))
        builder.add_item(torch.from_numpy(tokens))
        builder.end_document()
    builder.finalize(str(directory / f"{PREFIX}.idx"))


def ensure_indexed(corpus: Corpus, directory: Path) -> bool:
    """Make ``directory`` hold this corpus's verified .bin/.idx; True when it had to be (re)built.

    The caller holds the directory's lock. A directory whose meta or file digests do not match is
    treated as torn/corrupt and rebuilt in a temporary sibling, then swapped in atomically.
    """
    meta = read_json(directory / "meta.json")
    if meta and meta.get("format") == FORMAT and meta.get("digest") == corpus.digest:
        if manifest_matches(directory, meta.get("files", {})):
            return False
    if directory.exists():
        log.warning("data cache %s is incomplete or corrupt: rebuilding it", directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".tmp-{directory.name[:12]}-"))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    _write_indexed(corpus, tmp)
    files = files_manifest(tmp, [f"{PREFIX}.bin", f"{PREFIX}.idx"])
    write_json_atomic(tmp / "meta.json", {
        "format": FORMAT, "digest": corpus.digest, "source": corpus.source,
        "documents": [name for name, _ in corpus.documents],
        "num_bytes": corpus.num_bytes, "files": files,
    })
    publish_dir(tmp, directory)
    return True
