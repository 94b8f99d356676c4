"""Per-step state digests computed on the state's own device, sharded across data-parallel replicas
and checked replica against replica (the ``pos64r`` digests of fingerprint format v2).

Why: megatron's DDP buffers are replicated over the data-parallel group, and format v1 hashed all of
them, on every rank, on the host (a device-to-host copy of ~6 bytes per parameter per rank per step,
inside the step). Here every digest is a handful of torch integer ops on the tensor's device, launched
inside the step without a host sync; the small result tensors are resolved after it, at the log point
(``Pending.resolve``: one transfer per device a step).

Algorithm (pos64r). A *region* is an ordered list of tensors; each tensor's bytes are read as
little-endian int64 words in rows of ``ROW_WORDS`` (its last row zero-padded), the region's rows
numbered in order. Row sum ``S_r = sum_j g(C1*w[r,j] + colkey_j)``; row term ``T_r = g(C2*S_r +
rowkey_r)``; a chunk of rows has the value ``V = sum T_r`` (mod 2^64) and the digest
``splitmix64(V + C3*nbytes)`` (taken on the host when resolved); ``g(u) = u ^ (u >> 29)`` (torch's
arithmetic shift: two-to-one, ``u`` and ``~u`` collide, so a changed word goes unseen with
probability 2^-63, never systematically). Per word the map is keyed by its column and its row's key,
so permutations, equal pairs and zeros are all seen (``torch.hash_tensor``'s XOR sees none of them).
Integer sums are exact and order-free: the digest does not depend on threads, blocking or device.
Cost: on CUDA the row pass is one compiled kernel per matrix reading each word once
(``fused_row_pass``); the eager fallback moves ~8 bytes per byte (four elementwise passes and one
reduction per row block). Then one fused level-2 pass per device and step.

CPU tensors take a host fast path (``xxh3_64`` of each chunk's bytes, read in place: CPUs have no
fast vectorised 64-bit multiply, and nothing to overlap with); the chunks, slices and records are
the same. ``BITDET_DIGESTS=device`` runs the device path on CPU tensors too (what the tests use to
check that it makes no host copy and no host sync). A digest names its algorithm; digests of two
algorithms are never compared.

Sharding. A region replicated over a group of ``D`` ranks (``Group``) is cut into ``D`` slices of
whole rows, rank ``i`` owning rows ``[i*R//D, (i+1)*R//D)``, digested as ``K = CHECK_CHUNKS`` chunks.
At step ``s`` every member also digests the region's check chunk ``q = s mod (D*K)``: chunk ``q mod K``
of slice ``q // K`` (``train.step_fingerprints.Region.check_chunk``; its owner has it in its slice).
All ``D`` replicas digest the same bytes at the same step, so the reader (``analysis.replicas``)
compares ``D`` digests and a majority names a faulty replica; within ``D*K`` consecutive steps every
replica's copy of every replicated byte has been compared. A step's digest of the region is combined by the reader
from the members' chunks in group order (no collective in the step). An owned shard (megatron's
distributed optimizer: grads after the reduce-scatter, main params) and small per-rank state are
digested whole, by their one holder.

Bytes digested per rank per step (the cost model; +-2 rows of ``ROW_BYTES`` per slice):
    replicated region of R bytes, D replicas:  R if D == 1, else R/D + R/(D*K)
    owned shard of a region of R bytes:         R/D
    small state (module buffers, generators, FP8 scaling state): whole, on every rank
With Megatron-LM's ``--bf16 --use-distributed-optimizer`` (bf16 params, fp32 grads, fp32 main params),
P parameters: ``(2*(1 + 1/K) + 4 + 4) * P/(TP*PP*DP) = 10.5 * P/(TP*PP*DP)`` bytes at DP >= 2,
``10 * P/(TP*PP)`` at DP = 1 (the distributed optimizer's Adam moments, owned shards with no replica,
are not digested); without the distributed optimizer the three and Adam's two fp32 moments are all
replicated and digested: ``18 * (1 + 1/K) * P/(TP*PP*DP)``.
"""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import torch
import xxhash

from megatron_bitdet.fingerprint.tensor import _GOLDEN, _MASK64, _MIX1, _MIX2, _keys, _mix_

ALGO = "pos64r"
HOST_ALGO = "xxh3_64"
DEVICE_PATH_ON_CPU = os.environ.get("BITDET_DIGESTS") == "device"
ROW_WORDS = 512
ROW_BYTES = ROW_WORDS * 8
CHECK_CHUNKS = 4
_C3 = 0xD6E8FEB86659FD93
_BLOCK_WORDS = {"cpu": 1 << 19}       # words read per block: 4 MiB of int64 (cache-sized) on CPU
_DEVICE_BLOCK_WORDS = 1 << 25         # elsewhere: two 256 MiB int64 temporaries, 4 kernels a block
_ROW_KEYS: dict[str, torch.Tensor] = {}
_ZEROS: dict[str, torch.Tensor] = {}


@dataclass(frozen=True)
class Group:
    """The replicas of a region: a short id of the member ranks, this rank's index, the size."""

    key: str
    index: int
    size: int

    @classmethod
    def of(cls, process_group) -> "Group":
        ranks = torch.distributed.get_process_group_ranks(process_group)
        key = xxhash.xxh3_64_hexdigest(",".join(map(str, ranks)).encode())[:8]
        return cls(key, ranks.index(torch.distributed.get_rank()), len(ranks))


def row_keys(n: int, device) -> torch.Tensor:
    """Keys of rows 0..n-1 (a mixed sequence, cached per device and grown by doubling)."""
    dev = str(device)
    k = _ROW_KEYS.get(dev)
    if k is None or k.numel() < n:
        size = max(n, 2 * (0 if k is None else k.numel()), 1024)
        k = torch.arange(size, dtype=torch.int64, device=device).mul_(_GOLDEN).add_(_MIX2)
        _mix_(k, torch.empty_like(k))
        _ROW_KEYS[dev] = k
    return k[:n]


def _zeros(n: int, device) -> torch.Tensor:
    dev = str(device)
    z = _ZEROS.get(dev)
    if z is None or z.numel() < n:
        z = _ZEROS[dev] = torch.zeros(max(n, ROW_BYTES), dtype=torch.uint8, device=device)
    return z[:n]


def row_pass(m: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``S_r`` of a (rows, ROW_WORDS) int64 block, as one expression: a compiler fuses it into a single
    kernel that reads each word once (``torch.compile``: Triton on CUDA, C++ on CPU)."""
    t = torch.add(keys, m, alpha=_MIX1)
    return torch.bitwise_xor(t, torch.bitwise_right_shift(t, 29)).sum(1)


_FUSED: dict[str, object] = {}


def fused_row_pass(device_type: str):
    """``row_pass`` compiled for one device type, or None (eager blocks) where it is off or failed.

    On by default on CUDA, off on CPU (the host fast path serves CPU tensors); ``BITDET_DIGESTS_FUSED=1``
    / ``0`` forces it. Integer add, xor, shift and sum wrap mod 2^64 in any order, so the fused kernel's
    bits equal the eager ops' (tests/test_shards.py checks it on CPU). A compiler that fails at the first
    call (no Triton, no C++ compiler) switches this process to the eager blocks, with one warning."""
    if device_type not in _FUSED:
        forced = os.environ.get("BITDET_DIGESTS_FUSED")
        on = forced == "1" if forced in ("0", "1") else device_type == "cuda"
        _FUSED[device_type] = compiled_row_pass() if on else None
    return _FUSED[device_type]


@functools.cache
def compiled_row_pass():
    """``row_pass`` under ``torch.compile`` (made once; it compiles at its first call)."""
    return torch.compile(row_pass, dynamic=True, fullgraph=True)


def row_sums(m: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """``S_r`` for every row of an (rows, ROW_WORDS) int64 matrix: one fused kernel, or eager ops in
    blocks (cache-sized on CPU) whose temporaries are reused; ``fused`` None: the device's default."""
    keys = _keys(ROW_WORDS, m.device)
    fused = fused_row_pass(m.device.type) if fused is None else compiled_row_pass() if fused else None
    if fused is not None:
        try:
            return fused(m, keys)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager ops give the same bits
            warnings.warn(f"bitdet: the fused digest kernel is unavailable on {m.device.type} ({exc!r:.200}); "
                          "using eager torch ops (same digests, more memory traffic)", stacklevel=2)
            _FUSED[m.device.type] = None
    rows = m.shape[0]
    out = torch.empty(rows, dtype=torch.int64, device=m.device)
    step = max(1, _BLOCK_WORDS.get(m.device.type, _DEVICE_BLOCK_WORDS) // ROW_WORDS)
    t = torch.empty(min(step, rows), ROW_WORDS, dtype=torch.int64, device=m.device)
    u = torch.empty_like(t)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        tt, uu = t[:n], u[:n]
        torch.add(keys, m[r0:r0 + n], alpha=_MIX1, out=tt)
        tt.bitwise_xor_(torch.bitwise_right_shift(tt, 29, out=uu))
        torch.sum(tt, dim=1, out=out[r0:r0 + n])
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8) if t.dim() else t.detach().reshape(1).view(torch.uint8)


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a region sits: its first row, first byte (unpadded) and byte count."""

    first_row: tuple[int, ...]
    first_byte: tuple[int, ...]
    nbytes: tuple[int, ...]

    @classmethod
    def of(cls, tensors) -> "Layout":
        rows, offs, sizes, r, b = [], [], [], 0, 0
        for t in tensors:
            n = t.numel() * t.element_size()
            rows.append(r), offs.append(b), sizes.append(n)
            r, b = r + -(-n // ROW_BYTES), b + n
        return cls(tuple(rows), tuple(offs), tuple(sizes))

    @property
    def rows(self) -> int:
        return (self.first_row[-1] + -(-self.nbytes[-1] // ROW_BYTES)) if self.nbytes else 0

    @property
    def total(self) -> int:
        return sum(self.nbytes)

    def byte_of_row(self, r: int) -> int:
        """The (unpadded) byte offset where row ``r`` starts (the region's size at its end)."""
        for first, off, n in zip(reversed(self.first_row), reversed(self.first_byte), reversed(self.nbytes)):
            if r >= first:
                return off + min((r - first) * ROW_BYTES, n)
        return 0


def slice_rows(rows: int, index: int, size: int) -> tuple[int, int]:
    """The rows a group member owns: ``[index*rows//size, (index+1)*rows//size)``."""
    return index * rows // size, (index + 1) * rows // size


def chunk_rows(lo: int, hi: int, k: int) -> list[tuple[int, int]]:
    """``k`` chunks of ``ceil((hi-lo)/k)`` rows (the last ones shorter or empty)."""
    m = max(1, -(-(hi - lo) // k))
    return [(min(lo + j * m, hi), min(lo + (j + 1) * m, hi)) for j in range(k)]


@dataclass
class Job:
    """One digest request: the rows [lo, hi) of a region's tensors, cut into chunks (row bounds)."""

    tensors: list
    layout: Layout
    lo: int
    hi: int
    chunks: list[tuple[int, int]]
    tag: object = None                  # the caller's label for the result

    @property
    def algo(self) -> str:
        """``pos64r`` on the tensors' device, or ``xxh3_64`` on the host for CPU tensors."""
        on_host = not DEVICE_PATH_ON_CPU and all(t.device.type == "cpu" for t in self.tensors)
        return HOST_ALGO if on_host else ALGO

    def host_parts(self) -> list[tuple[int, int, str]]:
        """The host fast path: each chunk's bytes hashed in place (CPU tensors: no copy)."""
        parts = []
        for a, b in self.chunks:
            h = xxhash.xxh3_64()
            for t, first, n in zip(self.tensors, self.layout.first_row, self.layout.nbytes):
                lo, hi = max(a - first, 0) * ROW_BYTES, min(max(b - first, 0) * ROW_BYTES, n)
                if lo == 0 and hi == n:
                    h.update(_bytes(t).numpy())
                elif lo < hi:
                    h.update(memoryview(_bytes(t).numpy())[lo:hi])
            lo, hi = self.layout.byte_of_row(a), self.layout.byte_of_row(b)
            if hi > lo:
                parts.append((lo, hi, h.hexdigest()))
        return parts

    def matrices(self) -> list[torch.Tensor]:
        """(rows, ROW_WORDS) int64 views covering rows [lo, hi) in order: each tensor's whole rows
        read in place when 8-byte aligned, the rest (a last partial row, misaligned tensors) staged
        in one zero-padded copy."""
        parts, staged, device = [], [], None
        for t, first, n in zip(self.tensors, self.layout.first_row, self.layout.nbytes):
            rows = -(-n // ROW_BYTES)
            a, b = max(self.lo - first, 0), min(self.hi - first, rows)
            if a >= b:
                continue
            raw, device = _bytes(t), t.device
            aligned = (t.storage_offset() * t.element_size()) % 8 == 0
            whole = n // ROW_BYTES if aligned else 0
            if a < min(b, whole):
                parts.append(("view", raw[a * ROW_BYTES:min(b, whole) * ROW_BYTES].view(torch.int64).view(-1, ROW_WORDS)))
            if b > whole:
                s = max(a, whole) * ROW_BYTES
                piece = raw[s:min(b * ROW_BYTES, n)]
                pad = (b - max(a, whole)) * ROW_BYTES - piece.numel()
                parts.append(("staged", b - max(a, whole)))
                staged += [piece, _zeros(pad, device)] if pad else [piece]
        if staged:
            block = torch.cat(staged).view(torch.int64).view(-1, ROW_WORDS)
            out, at = [], 0
            for kind, p in parts:
                if kind == "view":
                    out.append(p)
                else:
                    out.append(block[at:at + p])
                    at += p
            return out
        return [p for _, p in parts]


class Pending:
    """Digests launched on their devices, not yet resolved: ``resolve()`` reads them all back with one
    transfer per device (at the log point, after the step)."""

    def __init__(self):
        self._done: list[tuple[Job, list]] = []
        self._values: list[tuple[torch.Tensor, list[Job]]] = []

    def launch(self, jobs: list[Job]) -> None:
        """Launch the jobs' digests (no host sync): one row pass per matrix, one level-2 pass a device;
        CPU tensors on the host fast path, at once."""
        by_device: dict[str, list[tuple[Job, list]]] = {}
        for job in jobs:
            if job.algo == HOST_ALGO:
                self._done.append((job, job.host_parts()))
                continue
            mats = job.matrices()
            if mats:
                by_device.setdefault(str(mats[0].device), []).append((job, mats))
            else:  # no bytes to read: every chunk empty
                self._values.append((None, [job]))
        for entries in by_device.values():
            sums = torch.cat([row_sums(m) for _, mats in entries for m in mats])
            device = sums.device
            keys = row_keys(max(job.hi for job, _ in entries), device)
            keys = torch.cat([keys[job.lo:job.hi] for job, _ in entries])
            t = torch.add(keys, sums, alpha=_MIX2)
            t.bitwise_xor_(torch.bitwise_right_shift(t, 29))
            values, at = [], 0
            for job, _ in entries:
                rows = job.hi - job.lo
                m = max(1, max(b - a for a, b in job.chunks))
                seg = t[at:at + rows]
                if len(job.chunks) * m != rows:
                    seg = torch.cat([seg, torch.zeros(len(job.chunks) * m - rows, dtype=torch.int64, device=device)])
                values.append(seg.view(len(job.chunks), m).sum(1))
                at += rows
            self._values.append((torch.cat(values), [job for job, _ in entries]))

    def resolve(self) -> list[tuple[Job, list[tuple[int, int, str]]]]:
        """(job, [(first byte, end byte, hex digest) per chunk]) for every launched job (host-path jobs
        first, then per device in launch order); empty chunks left out."""
        out, self._done = self._done, []
        by_device: dict[str, list[torch.Tensor]] = {}
        for values, _ in self._values:
            if values is not None:
                by_device.setdefault(str(values.device), []).append(values)
        read = {dev: iter(torch.cat(vs).tolist()) for dev, vs in by_device.items()}  # one transfer a device
        for values, jobs in self._values:
            n = sum(len(j.chunks) for j in jobs)
            flat = [0] * n if values is None else [next(read[str(values.device)]) for _ in range(n)]
            at = 0
            for job in jobs:
                parts = []
                for (a, b), v in zip(job.chunks, flat[at:at + len(job.chunks)]):
                    lo, hi = job.layout.byte_of_row(a), job.layout.byte_of_row(b)
                    if hi > lo:
                        parts.append((lo, hi, finish(v, hi - lo)))
                at += len(job.chunks)
                out.append((job, parts))
        self._values.clear()
        return out


def finish(value: int, nbytes: int) -> str:
    """A chunk's digest from its value and byte count: splitmix64, as 16 hex digits."""
    z = (value + _C3 * nbytes) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return f"{z ^ (z >> 31):016x}"


def whole_job(tensors, tag=None) -> Job:
    """A job digesting every byte of ``tensors`` as one chunk."""
    layout = Layout.of(tensors)
    return Job(list(tensors), layout, 0, layout.rows, [(0, layout.rows)], tag)


def combine(hexes) -> str:
    """One 64-bit digest of several digests, in the given order (the per-rank and per-step folds)."""
    return xxhash.xxh3_64_hexdigest("\x00".join(hexes).encode())


def named_digest(named, tag=None) -> tuple[Job, str]:
    """(job, metadata fold) for a named group of small tensors (module buffers, generator states):
    the bytes are digested on the device; names, dtypes and shapes are mixed in when resolved."""
    named = list(named)
    meta = "\x00".join(f"{n}\x00{str(t.dtype).removeprefix('torch.')}\x00{tuple(t.shape)}" for n, t in named)
    return whole_job([t for _, t in named], tag), xxhash.xxh3_64_hexdigest(meta.encode())


def state_digest(named) -> str:
    """One pos64r digest over named tensors (or bare tensors, named by position), resolved now
    (outside a step: a restore check, a test). Names, dtypes, shapes, order and bytes all count."""
    named = [item if isinstance(item, tuple) else (str(i), item) for i, item in enumerate(named)]
    job, meta = named_digest(named)
    pending = Pending()
    pending.launch([job])
    (_, parts), = pending.resolve()
    return f"{job.algo}:{combine([meta, *(h for _, _, h in parts)])}"
