"""Live-state snapshots for checkpoint-resume validation, as digests.

The reference run snapshots its in-memory state after step K; a resumed run snapshots right after
restoring K. Both come from the live objects, not from the checkpoint files, so a restore that skips
or mangles a component shows up as a difference.

A snapshot is a digest file (``snapshots/iter_K/rank_R.json``), not a copy of the state: a rank's
state is tens of GB at production scale and a resume point's full copy terabytes. Format (version 1):

    {"format": "bitdet-snapshot-digests", "version": 1, "step": K, "rank": R, "chunk_bytes": 1048576,
     "leaves": [[component, key, value], ...]}

one entry per leaf of the state (``leaves``: components ``parameters`` or ``bf16_compute_copy`` +
``fp32_main_params``, ``buffers``, ``fp8_scaling``, NVFP4's ``fp4_sr_rng`` / ``fp4_hadamard_signs`` /
``fp4_block_scales`` / ``fp4_values``, ``optimizer``, ``scheduler``, ``rng.<generator>``,
``data``, ``logical`` (the rank's partial ``lsum64`` digests: ``params``, ``main_params``, ``exp_avg``,
``exp_avg_sq``); keys dotted, list items ``[i]``). A value is an int, bool, string or null as it is;
``{"float": "<16 hex digits>"}`` (the IEEE-754 bits, so -0.0 and NaN payloads survive); or
``{"tensor": {"dtype", "shape", "chunks"}}``: the position-sensitive digest (``fingerprint.tensor.
row_digests``, computed on the tensor's own device; 16 hex digits) of every ``chunk_bytes`` piece of
its bytes, the last piece shorter. Equal digests of every chunk, dtype and shape: equal tensors.

Full tensors go to ``rank_R.full.pt`` (torch.save; ``{"step", "rank", "leaves": [[component, key,
tensor], ...]}``, read with ``weights_only``) only for the leaves a selection names: verify-resume's
targeted second pass (the tensors whose digests differed, for element counts) or ``all``
(``--full-snapshots``).
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.fingerprint.tensor import dtype_name, row_digests
from megatron_bitdet.rundir import load_tensors, read_result, snapshot_full_path, snapshot_path
from megatron_bitdet.train import precision
from megatron_bitdet.train.checkpoint import capture_rng
from megatron_bitdet.train.module_state import capture_module_rng, module_buffers
from megatron_bitdet.train.step_fingerprints import logical_partials

FORMAT = "bitdet-snapshot-digests"
VERSION = 1
CHUNK_BYTES = 1 << 20  # 1 MiB: a differing chunk localizes a difference to 2^18 fp32 elements
ALL = "all"
# Snapshot entries that are split one level deeper into components of their own (rng.python, ...).
_SPLIT = ("rng",)
_HEX16 = re.compile(r"[0-9a-f]{16}")

# Restore components a fault-injection test may skip (``--fault-skip-restore``); never set in real runs.
# compute_copy.rounding: the bf16 compute copy converted from the fp32 source rounding toward zero;
# fp8.amax_history: the FP8 delayed-scaling state left fresh; fp4.*: ``precision.FP4_FAULTS``.
FAULTS = ("rng.python", "rng.numpy", "rng.torch_cpu", "rng.tracker", "rng.module", "data", "optimizer.exp_avg",
          "scheduler", "compute_copy.rounding", "fp8.amax_history", *precision.FP4_FAULTS)


@dataclass(frozen=True, repr=False)
class TensorDigest:
    """A tensor leaf as the digest file holds it: equal to another exactly when the tensors are."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[str, ...]
    chunk_bytes: int

    def __repr__(self) -> str:  # what a verdict shows of it: never its chunk list
        return f"tensor {self.dtype}{self.shape}"

    @property
    def itemsize(self) -> int:
        return getattr(torch, self.dtype).itemsize

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def differing_chunks(self, other: "TensorDigest") -> list[int]:
        return [i for i, (a, b) in enumerate(zip(self.chunks, other.chunks)) if a != b]

    def describe(self, chunks: list[int]) -> str:
        """Where differing chunks lie, in elements of the flattened tensor."""
        per = self.chunk_bytes // self.itemsize
        first = chunks[0]
        return (f"digests of {len(chunks)} of {len(self.chunks)} chunks ({self.chunk_bytes} bytes each) differ; "
                f"first chunk {first}: elements {first * per}-{min(self.numel, (first + 1) * per) - 1}")


def tensor_digest(t: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> TensorDigest:
    """Digests of every ``chunk_bytes`` piece of ``t``'s bytes, computed on its device (one small
    device-to-host read of the digests, never of the tensor). Bytes whose start is not 8-aligned in
    storage are copied on the device first, so a digest never depends on where the tensor lies."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.storage_offset() % 8:
        flat = flat.clone()
    whole = flat.numel() // chunk_bytes * chunk_bytes
    chunks = row_digests(flat[:whole].view(-1, chunk_bytes)) if whole else []
    if whole != flat.numel():
        chunks += row_digests(flat[whole:].view(1, -1))
    return TensorDigest(dtype_name(t.dtype), tuple(t.shape), tuple(chunks), chunk_bytes)


def _optimizer_state(optimizer) -> dict:
    out = {}
    for oi, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = opt.optimizer
        for gi, group in enumerate(inner.param_groups):
            prefix = f"optimizer{oi}.group{gi}"
            for key, value in group.items():
                if key != "params" and isinstance(value, (int, float, bool, tuple)):
                    out[f"{prefix}.{key}"] = value
            for pi, param in enumerate(group["params"]):
                out[f"{prefix}.param{pi}.value"] = param.detach()
                for key, value in inner.state.get(param, {}).items():
                    out[f"{prefix}.param{pi}.{key}"] = value.detach() if torch.is_tensor(value) else value
    return out


def live_state(*, ddp_modules, optimizer, scheduler, data) -> dict:
    """Components: ``parameters`` (in a mixed-precision run ``bf16_compute_copy``, next to its source
    ``fp32_main_params``), ``buffers``, ``fp8_scaling`` when FP8 keeps state, NVFP4's components
    (``precision.fp4_state``), optimizer, scheduler, rng, data, and ``logical``: this rank's partial
    logical digests of the params, main params and optimizer state (``step_fingerprints.logical_partials``:
    their sum over the ranks does not depend on the data-parallel layout, so a restore at another DP size
    compares the distributed optimizer's shards through it). The live tensors themselves (not copies):
    read them before the next step."""
    params = {f"{i}.{name}": p.detach() for i, m in enumerate(ddp_modules) for name, p in m.module.named_parameters()}
    compute_copy = precision.compute_copy_name(ddp_modules)
    chunks = [m.module for m in ddp_modules]
    rng = capture_rng()
    rng.update({f"module:{where}": s for where, s in capture_module_rng(chunks).items()})
    state = {compute_copy or "parameters": params, "buffers": dict(module_buffers(chunks))}
    if compute_copy:
        state["fp32_main_params"] = dict(precision.main_params(ddp_modules))
    fp8 = precision.fp8_scaling_state(ddp_modules)
    if fp8:
        state["fp8_scaling"] = dict(fp8)
    state.update(precision.fp4_state(ddp_modules))
    state.update({"optimizer": _optimizer_state(optimizer), "scheduler": dict(scheduler.state_dict()), "rng": rng,
                  "data": data.state_dict(), "logical": logical_partials(ddp_modules, optimizer)})
    return state


def leaves(state: dict):
    """(component, key, value) for every leaf: ``rng``'s generators are components of their own."""
    for name, value in state.items():
        if name in _SPLIT and isinstance(value, dict):
            for sub, v in value.items():
                yield from _walk(f"{name}.{sub}", v, "")
        else:
            yield from _walk(name, value, "")


def _walk(component: str, value, prefix: str):
    if isinstance(value, dict):
        for key, v in value.items():
            yield from _walk(component, v, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(component, v, f"{prefix}[{i}]")
    else:
        yield component, prefix or component, value


def _encode(component: str, key: str, value):
    if torch.is_tensor(value):
        d = tensor_digest(value)
        return {"tensor": {"dtype": d.dtype, "shape": list(d.shape), "chunks": list(d.chunks)}}
    if isinstance(value, float):
        return {"float": struct.pack(">d", value).hex()}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise TypeError(f"snapshot leaf {component} {key}: a {type(value).__name__} has no digest-file form")


def read_selection(spec) -> frozenset | str | None:
    """``take_snapshot``'s ``full``: None, ``all``, or a selection file (``write_selection``) -> the
    (component, key) pairs it names; BitdetInputError naming the file when it is not one."""
    if spec is None or spec == ALL or isinstance(spec, frozenset):
        return spec
    data = read_result(spec, "snapshot selection", ("leaves",))
    if data is None:
        raise BitdetInputError(f"{spec}: snapshot selection missing")
    pairs = data["leaves"]
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                                              for p in pairs):
        raise BitdetInputError(f"{spec}: not a snapshot selection (leaves is not a list of [component, key])")
    return frozenset(map(tuple, pairs))


def write_selection(path, pairs) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"leaves": sorted(map(list, set(pairs)))}))
    return path


def take_snapshot(run_dir, step: int, *, rank: int, ddp_modules, optimizer, scheduler, data, full=None) -> Path:
    """This rank's digest file for ``step``; ``full`` (``read_selection``) also writes those tensors
    in full (host copies) to ``rank_R.full.pt``. Returns the digest file."""
    selected = read_selection(full)
    entries, tensors = [], []
    for component, key, value in leaves(live_state(ddp_modules=ddp_modules, optimizer=optimizer,
                                                   scheduler=scheduler, data=data)):
        entries.append([component, key, _encode(component, key, value)])
        if torch.is_tensor(value) and (selected == ALL or selected and (component, key) in selected):
            tensors.append([component, key, value.detach().to("cpu", copy=True)])
    path = snapshot_path(run_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    if selected:
        full_path = snapshot_full_path(run_dir, step, rank)
        torch.save({"step": step, "rank": rank, "leaves": tensors}, full_path.with_suffix(".tmp"))
        full_path.with_suffix(".tmp").replace(full_path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "version": VERSION, "step": step, "rank": rank,
                               "chunk_bytes": CHUNK_BYTES, "leaves": entries}, separators=(",", ":")))
    tmp.replace(path)
    return path


def inject_restore_faults(faults, *, ddp_modules, optimizer, scheduler_state_before: dict, scheduler, data,
                          data_state_before):
    """Undo selected parts of a restore, as a buggy resume would (test-only)."""
    for fault in faults:
        if fault not in FAULTS:
            raise ValueError(f"unknown restore fault {fault!r}; known: {', '.join(FAULTS)}")
    if "compute_copy.rounding" in faults:
        precision.fault_round_compute_copy(optimizer)
    if "fp8.amax_history" in faults:
        precision.fault_drop_fp8_scaling(ddp_modules)
    for fault in precision.FP4_FAULTS:
        if fault in faults:
            precision.fault_fp4(ddp_modules, fault)
    if "optimizer.exp_avg" in faults:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            for param_state in opt.optimizer.state.values():
                if "exp_avg" in param_state:
                    param_state["exp_avg"].zero_()
    if "scheduler" in faults:
        scheduler.load_state_dict(scheduler_state_before)
    if "data" in faults:
        data.load_state_dict(data_state_before)


@dataclass
class Snapshot:
    """A digest file as read: ``leaves`` maps (component, key) to a value or a TensorDigest, in file order."""

    path: Path
    step: int
    rank: int
    leaves: dict


def _decode(path, i: int, value, chunk_bytes: int):
    bad = BitdetInputError(f"{path}: not a live-state snapshot (leaves[{i}] holds no value of the digest-file form)")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise bad
    if "float" in value:
        bits = value["float"]
        if not isinstance(bits, str) or not _HEX16.fullmatch(bits):
            raise bad
        return struct.unpack(">d", bytes.fromhex(bits))[0]
    t = value.get("tensor")
    if not isinstance(t, dict) or set(t) != {"dtype", "shape", "chunks"}:
        raise bad
    dtype, shape, chunks = t["dtype"], t["shape"], t["chunks"]
    if (not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype)
            or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
            or not isinstance(chunks, list) or not all(isinstance(c, str) and _HEX16.fullmatch(c) for c in chunks)):
        raise bad
    digest = TensorDigest(dtype, tuple(shape), tuple(chunks), chunk_bytes)
    if len(chunks) != -(-digest.numel * digest.itemsize // chunk_bytes):
        raise BitdetInputError(f"{path}: leaves[{i}] holds {len(chunks)} chunk digests for a {dtype}{tuple(shape)}, "
                               "not one per chunk (a truncated or edited digest file)")
    return digest


def read_snapshot(path) -> Snapshot:
    """A digest file as ``take_snapshot`` writes it; BitdetInputError naming the file otherwise (missing,
    corrupt, another format or version, a malformed or truncated leaf): never a partial comparison."""
    data = read_result(path, "live-state snapshot", ("format", "version", "step", "rank", "chunk_bytes", "leaves"))
    if data is None:
        raise BitdetInputError(f"{path}: live-state snapshot missing")
    if data["format"] != FORMAT or data["version"] != VERSION:
        raise BitdetInputError(f"{path}: not a live-state snapshot of this bitdet ({data['format']!r} version "
                               f"{data['version']!r}; expected {FORMAT!r} version {VERSION})")
    step, rank, chunk_bytes, entries = data["step"], data["rank"], data["chunk_bytes"], data["leaves"]
    if (type(step) is not int or type(rank) is not int or type(chunk_bytes) is not int or chunk_bytes <= 0
            or chunk_bytes % 16 or not isinstance(entries, list)):
        raise BitdetInputError(f"{path}: not a live-state snapshot (step, rank, chunk_bytes or leaves malformed)")
    out = {}
    for i, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 3 and all(isinstance(x, str) for x in entry[:2])):
            raise BitdetInputError(f"{path}: not a live-state snapshot (leaves[{i}] is not [component, key, value])")
        key = (entry[0], entry[1])
        if key in out:
            raise BitdetInputError(f"{path}: leaf {entry[0]} {entry[1]} appears twice")
        out[key] = _decode(path, i, entry[2], chunk_bytes)
    return Snapshot(Path(path), step, rank, out)


def read_full(path) -> dict:
    """A full-tensor file (``rank_R.full.pt``) as {(component, key): tensor}; BitdetInputError naming it."""
    data = load_tensors(path, "full-tensor snapshot")
    entries = data.get("leaves") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(
            isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[1], str)
            and torch.is_tensor(e[2]) for e in entries):
        raise BitdetInputError(f"{path}: not a full-tensor snapshot (expected leaves of [component, key, tensor])")
    return {(c, k): t for c, k, t in entries}


def check_snapshots(run_dir, steps, nproc: int, how: str) -> None:
    """A reused reference must hold a readable snapshot for every resume step and rank: refused before
    any segment trains, not after. ``how``: what makes a reference with these snapshots."""
    for k in steps:
        for rank in range(nproc):
            path = snapshot_path(run_dir, k, rank)
            if not path.is_file():
                raise BitdetInputError(f"{run_dir}: no live-state snapshot for iteration {k} rank {rank} ({path}); "
                                       f"{how}")
            snap = read_snapshot(path)
            if (snap.step, snap.rank) != (k, rank):
                raise BitdetInputError(f"{path}: the snapshot is of step {snap.step} rank {snap.rank}")
