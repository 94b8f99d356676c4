"""What the kernel and module checks share: one repeat (identical inputs, restored RNG, fixed
cotangents, forward + backward), the named tensors it produced, and their byte-for-byte comparison
down to the first differing element."""
from __future__ import annotations

import os
import random
import site
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from megatron_bitdet.fingerprint.floatbits import encode_float

COTANGENT_SEED = 0x5EED


class NondeterminismError(AssertionError):
    """A repeat with identical inputs and RNG produced different bytes (``differences`` says where)."""

    def __init__(self, message: str, differences=()):
        super().__init__(message)
        self.differences = list(differences)


@dataclass(frozen=True)
class Difference:
    """The first place two repeats' tensors of one name disagree."""

    name: str
    detail: str  # "12 of 1024 elements differ; first at [5, 3]: ..." or a shape/dtype/presence mismatch

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


@dataclass
class CheckReport:
    """What a passing check compared (a verdict covers only this)."""

    subject: str
    repeats: int
    settings: List[str]  # one per compared configuration, e.g. "threads=2" or "layout tp2, rank 1, threads=1"
    tensors: List[str] = field(default_factory=list)
    elements: int = 0
    notes: List[str] = field(default_factory=list)  # what limits what the pass shows (oversubscribed cores)

    def __str__(self) -> str:
        return (f"{self.subject}: bitwise repeatable — {self.repeats} repeats x {len(self.settings)} "
                f"configuration(s) ({'; '.join(self.settings)}), {len(self.tensors)} tensors, "
                f"{self.elements} elements compared" + "".join(f"; note: {n}" for n in self.notes))


def named_tensors(obj, name: str) -> Dict[str, Any]:
    """Every tensor in a (nested) tuple / list / dict, keyed like ``output[0]['y']``; other leaves are
    kept too when they are numbers or None so a changed scalar or a vanished tensor is noticed."""
    if isinstance(obj, torch.Tensor) or obj is None or isinstance(obj, (bool, int, float, str)):
        return {name: obj}
    if isinstance(obj, (tuple, list)):
        out = {}
        for i, item in enumerate(obj):
            out.update(named_tensors(item, f"{name}[{i}]"))
        return out
    if isinstance(obj, dict):
        out = {}
        for key, item in obj.items():
            out.update(named_tensors(item, f"{name}[{key!r}]"))
        return out
    raise TypeError(f"{name}: cannot compare a {type(obj).__name__}; return tensors (or tuples/lists/dicts of them)")


def _element_bits(flat: torch.Tensor, u8: torch.Tensor, i: int) -> str:
    if flat.dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        return f"{flat[i].item()!r} ({encode_float(flat[i])})"
    raw = bytes(u8[i].tolist()[::-1]).hex()  # most significant byte first (little-endian host)
    try:
        return f"{flat[i].item()!r} ({str(flat.dtype).removeprefix('torch.')}:{raw})"
    except (RuntimeError, TypeError):
        return f"bits {raw}"


def first_difference(name: str, a, b) -> Optional[Difference]:
    """None when ``a`` and ``b`` are byte-identical (dtype, shape and every element's bits)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return Difference(name, f"{type(a).__name__} vs {type(b).__name__} (missing in one repeat)")
        return None if a == b else Difference(name, f"{a!r} vs {b!r}")
    if a.dtype != b.dtype or a.shape != b.shape:
        return Difference(name, f"{a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
    fa, fb = a.detach().cpu().contiguous().reshape(-1), b.detach().cpu().contiguous().reshape(-1)
    ua, ub = fa.view(torch.uint8).reshape(fa.numel(), -1), fb.view(torch.uint8).reshape(fb.numel(), -1)
    differs = (ua != ub).any(dim=1)
    count = int(differs.sum())
    if count == 0:
        return None
    i = int(differs.nonzero()[0, 0])
    index = list(torch.unravel_index(torch.tensor(i), tuple(a.shape))) if a.dim() else []
    where = "[" + ", ".join(str(int(k)) for k in index) + "]"
    return Difference(name, f"{count} of {fa.numel()} elements differ ({a.dtype}, shape {tuple(a.shape)}); "
                            f"first at {where}: {_element_bits(fa, ua, i)} vs {_element_bits(fb, ub, i)}")


def compare(reference: Dict[str, Any], other: Dict[str, Any]) -> List[Difference]:
    """Every named tensor of two repeats, in the reference's order (names only in one side included)."""
    diffs = []
    for name in list(reference) + [n for n in other if n not in reference]:
        d = first_difference(name, reference.get(name), other.get(name))
        if d is not None:
            diffs.append(d)
    return diffs


class RngState:
    """Every RNG a kernel may draw from: torch CPU, CUDA (when initialized), Python's ``random``, numpy's
    global generator (when imported) and megatron's model-parallel tracker (when in use)."""

    def __init__(self):
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.random = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None
        self.tracker = _megatron_tracker()
        self.tracker_states = self.tracker.get_states() if self.tracker is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.random)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
        if self.tracker is not None:
            self.tracker.set_states(self.tracker_states)


def _megatron_tracker():
    module = sys.modules.get("megatron.core.tensor_parallel.random")
    if module is None:
        return None
    tracker = module.get_cuda_rng_tracker()
    return tracker if tracker.get_states() else None


def _fresh(value):
    """An identical, independent copy of one input (leaf tensors keep requires_grad)."""
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        return copy.requires_grad_(value.requires_grad) if copy.is_floating_point() or copy.is_complex() else copy
    if isinstance(value, (tuple, list)):
        return type(value)(_fresh(v) for v in value)
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


def _cotangent(t: torch.Tensor, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(COTANGENT_SEED + index)
    return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(dtype=t.dtype, device=t.device)


def run_once(fn, args=(), kwargs=None, *, backward: bool = True) -> Dict[str, Any]:
    """Call ``fn`` on fresh copies of the inputs; backward with seeded cotangents (the same every
    repeat). Returns outputs, every input leaf's gradient and, for a module, every parameter's."""
    args, kwargs = _fresh(tuple(args)), _fresh(dict(kwargs or {}))
    params = list(fn.named_parameters()) if isinstance(fn, torch.nn.Module) else []
    for _, p in params:
        p.grad = None
    out = fn(*args, **kwargs)
    result = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
              for k, v in named_tensors(out, "output").items()}
    if backward:
        outs = [t for t in named_tensors(out, "output").values() if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [_cotangent(t, i) for i, t in enumerate(outs)])
        leaves = {**named_tensors(list(args), "input"), **named_tensors(kwargs, "input")}
        for name, leaf in leaves.items():
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                result[f"grad of {name}"] = None if leaf.grad is None else leaf.grad.clone()
        for pname, p in params:
            if p.requires_grad:
                result[f"grad of parameter {pname}"] = None if p.grad is None else p.grad.clone()
    if not any(isinstance(v, torch.Tensor) for v in result.values()):
        raise TypeError("nothing to compare: the function returned no tensor")
    return result


def child_import_env() -> Dict[str, str]:
    """Environment for fresh interpreters (spawned ranks, runs) that can import what this process can:
    the entries of ``sys.path`` a new interpreter would not have (a test's directory, a project root)
    go into PYTHONPATH, so a builder or model provider defined next to the tests imports there too."""
    standard = tuple({os.path.realpath(p) for p in (*sysconfig.get_paths().values(), *site.getsitepackages(),
                                                    site.getusersitepackages()) if p})
    extra = [p for p in (os.path.abspath(p) for p in sys.path if p) if os.path.isdir(p)
             and not any(os.path.realpath(p) == d or os.path.realpath(p).startswith(d + os.sep) for d in standard)]
    previous = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(extra + ([previous] if previous else [])))}


def elements(tensors: Dict[str, Any]) -> int:
    return sum(t.numel() for t in tensors.values() if isinstance(t, torch.Tensor))
