"""Capture one op occurrence's actual inputs and outputs (the kernel rung of the ladder).

Inside the trace window, on one rank, the op whose run-independent event id matches is recorded:
its arguments (tensors cloned BEFORE it runs: in-place ops mutate them), its outputs, the thread
count and torch's deterministic flag it ran under, and where a custom op's Python definition lives.
One file per rank (``RUN_DIR/captures/rank_XXXXX.capture.pt``), written with ``torch.save`` of plain
containers and tensors only, so ``load_capture`` reads it with ``weights_only=True``. Tensors are
stored contiguous with their recorded shape and strides beside them (replay rebuilds either layout).
Inputs above ``max_bytes`` are not stored: the file then says so and carries the metadata only.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.rundir import capture_path, load_tensors

FORMAT = "bitdet-capture"
VERSION = 1
DEFAULT_MAX_BYTES = 256 << 20
_SCALARS = (bool, int, float, str, type(None))


class Unsupported(Exception):
    """An argument that cannot be written as plain data (it is named in the capture instead)."""


def encode(obj, tensors: list):
    """Arguments as plain data: tensors become {"tensor": i} (appended to ``tensors``)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"tensor": len(tensors) - 1}
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, list):
        return [encode(x, tensors) for x in obj]
    if isinstance(obj, tuple):
        return {"tuple": [encode(x, tensors) for x in obj]}
    if isinstance(obj, dict):
        return {"dict": {str(k): encode(v, tensors) for k, v in obj.items()}}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    if isinstance(obj, (torch.layout, torch.memory_format)):
        return {"torch": str(obj).removeprefix("torch.")}
    raise Unsupported(type(obj).__name__)


def decode(obj, tensors: list):
    """Inverse of ``encode`` with ``tensors`` as rebuilt by the replay."""
    if isinstance(obj, list):
        return [decode(x, tensors) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if "tensor" in obj:
        return tensors[obj["tensor"]]
    if "tuple" in obj:
        return tuple(decode(x, tensors) for x in obj["tuple"])
    if "dict" in obj:
        return {k: decode(v, tensors) for k, v in obj["dict"].items()}
    if "dtype" in obj:
        return getattr(torch, obj["dtype"])
    if "device" in obj:
        return torch.device(obj["device"])
    return getattr(torch, obj["torch"])


def _meta(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).removeprefix("torch."),
            "device": str(t.device)}


def _stored(t: torch.Tensor) -> dict:
    data = t.detach()
    if data.is_conj() or data.is_neg():
        data = data.resolve_conj().resolve_neg()
    return {"data": data.clone(memory_format=torch.contiguous_format), **_meta(t)}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def op_home(func) -> str | None:
    """The Python module that defines a custom (non-ATen) op, for the replay process to import."""
    if func.namespace in ("aten", "prims"):
        return None
    try:
        from torch._library.custom_ops import OPDEFS

        opdef = OPDEFS.get(f"{func.namespace}::{func._schema.name.split('::')[-1]}")
        return getattr(getattr(opdef, "_init_fn", None), "__module__", None)
    except (ImportError, AttributeError):
        return None


class OpCapture:
    """Arms on one event id; ``before`` clones the inputs, ``after`` writes the file (once)."""

    def __init__(self, run_dir, rank: int, event_id: str, max_bytes: int = DEFAULT_MAX_BYTES, context: dict = None):
        self.path = capture_path(run_dir, rank)
        self.rank, self.event_id, self.max_bytes = rank, event_id, max_bytes
        self.context = dict(context or {})
        self.done = False

    def before(self, func, args, kwargs) -> dict:
        tensors: list = []
        rec = {"format": FORMAT, "v": VERSION, "rank": self.rank, "event_id": self.event_id, "op": str(func),
               "namespace": func.namespace, "home": op_home(func),
               "arg_names": [a.name for a in func._schema.arguments], "threads": torch.get_num_threads(),
               "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
               "torch": str(torch.__version__), **self.context}
        try:
            rec["args"] = encode(list(args), tensors)
            rec["kwargs"] = encode(dict(kwargs), tensors)["dict"]
        except Unsupported as exc:
            rec["unsupported"] = f"argument of type {exc} cannot be stored"
            return rec
        size = _nbytes(tensors)
        rec["input_bytes"] = size
        if size > self.max_bytes:
            rec["too_large"] = f"inputs are {size} bytes (> {self.max_bytes}): metadata only"
            rec["inputs"] = [_meta(t) for t in tensors]
            return rec
        rec["inputs"] = [_stored(t) for t in tensors]
        return rec

    def after(self, rec: dict, out) -> None:
        if "inputs" in rec and "too_large" not in rec and "unsupported" not in rec:
            outs: list = []
            try:
                rec["result"] = encode(out, outs)
                rec["outputs"] = [_stored(t) for t in outs]
            except Unsupported as exc:
                rec["unsupported"] = f"output of type {exc} cannot be stored"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        torch.save(rec, tmp)
        tmp.replace(self.path)
        self.done = True


def rebuild(stored: dict, strided: bool) -> torch.Tensor:
    """A stored tensor, contiguous or with its recorded strides (overlapping ones included)."""
    data = stored["data"]
    shape, stride = stored["shape"], stored["stride"]
    if not strided or list(data.stride()) == stride or data.numel() == 0:
        return data.clone()
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    storage = torch.zeros(span, dtype=data.dtype, device=data.device)
    index = torch.arange(span, device=data.device).as_strided(shape, stride)
    storage[index.reshape(-1)] = data.reshape(-1)  # aliasing positions hold equal values (an expand)
    return storage.as_strided(shape, stride)


def load_capture(path) -> dict:
    """A capture file, validated; BitdetInputError naming the file on anything else."""
    path = Path(path)
    if not path.is_file():
        raise BitdetInputError(f"{path}: capture file missing")
    rec = load_tensors(path, "capture", map_location="cpu" if not torch.cuda.is_available() else None)
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise BitdetInputError(f"{path}: foreign file (no '{FORMAT}' record)")
    if rec.get("v") != VERSION:
        raise BitdetInputError(f"{path}: capture version {rec.get('v')!r}, expected {VERSION}")
    problem = _capture_problem(rec)
    if problem:
        raise BitdetInputError(f"{path}: {problem}")
    return rec


def _ints(x) -> bool:
    return isinstance(x, list) and all(type(v) is int and v >= 0 for v in x)


def _tensor_problem(t, what: str) -> str | None:
    if not isinstance(t, dict) or not _ints(t.get("shape")) or not _ints(t.get("stride")) \
            or len(t["shape"]) != len(t["stride"]) or not isinstance(t.get("dtype"), str) \
            or not isinstance(t.get("device", ""), str):
        return f"{what} is malformed (expected shape and stride lists of equal length, dtype and device names)"
    if "data" in t and (not isinstance(t["data"], torch.Tensor) or list(t["data"].shape) != t["shape"]
                        or math.prod(t["shape"]) != t["data"].numel()):
        return f"{what}: stored data does not match its shape"
    return None


def _argument_problem(obj, n_tensors: int, where: str, depth: int = 0) -> str | None:
    """The encoded arguments ``decode`` can rebuild: tensor indices in range, torch names that exist."""
    if depth > 32:
        return f"{where}: nested too deep"
    if isinstance(obj, list):
        return next((p for i, x in enumerate(obj) if (p := _argument_problem(x, n_tensors, f"{where}[{i}]", depth + 1))),
                    None)
    if isinstance(obj, _SCALARS):
        return None
    if not isinstance(obj, dict) or len(obj) != 1:
        return f"{where}: {type(obj).__name__} is not an encoded argument"
    (kind, value), = obj.items()
    if kind == "tensor":
        ok = type(value) is int and 0 <= value < n_tensors
    elif kind == "tuple":
        return _argument_problem(value, n_tensors, where, depth + 1) if isinstance(value, list) else f"{where}: bad tuple"
    elif kind == "dict":
        if not isinstance(value, dict):
            return f"{where}: bad dict"
        return next((p for k, v in value.items() if (p := _argument_problem(v, n_tensors, f"{where}.{k}", depth + 1))),
                    None)
    elif kind == "dtype":
        ok = isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)
    elif kind == "device":
        try:
            torch.device(value)
            ok = isinstance(value, str)
        except (RuntimeError, TypeError):
            ok = False
    elif kind == "torch":
        ok = isinstance(value, str) and isinstance(getattr(torch, value, None), (torch.layout, torch.memory_format))
    else:
        ok = False
    return None if ok else f"{where}: {kind!r} {value!r} is not an encoded argument"


def _capture_problem(rec: dict) -> str | None:
    """What a capture holds that ``replay_op`` could not use (None: nothing): the fields as ``before`` /
    ``after`` write them."""
    for key, kind in (("op", str), ("event_id", str), ("rank", int), ("threads", int), ("arg_names", list)):
        if key not in rec:
            return f"capture lacks {key!r}"
        if type(rec[key]) is not kind:
            return f"capture field {key!r} is {type(rec[key]).__name__}, expected {kind.__name__}"
    if rec["threads"] < 1 or not all(isinstance(n, str) for n in rec["arg_names"]):
        return "capture field 'threads' or 'arg_names' is malformed"
    if "unsupported" in rec or "too_large" in rec:
        return None  # metadata only: replay_op refuses it, naming why
    if type(rec.get("deterministic_algorithms")) is not bool:
        return "capture field 'deterministic_algorithms' is missing or not a bool"
    for key in ("inputs", "outputs"):
        if not isinstance(rec.get(key), list):
            return f"capture field {key!r} is missing or not a list"
        for i, t in enumerate(rec[key]):
            problem = _tensor_problem(t, f"{key[:-1]} {i}")
            if problem:
                return problem
            if "data" not in t:
                return f"{key[:-1]} {i} has no stored data"
    if not isinstance(rec.get("args"), list) or not isinstance(rec.get("kwargs"), dict):
        return "capture fields 'args' (a list) and 'kwargs' (a mapping) are required"
    return (_argument_problem(rec["args"], len(rec["inputs"]), "args")
            or _argument_problem({"dict": rec["kwargs"]}, len(rec["inputs"]), "kwargs"))
