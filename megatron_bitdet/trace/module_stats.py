"""Per-module statistics of one rank's steps, and their on-disk format (owned here: writer and reader).

For every module: its place in the step's order of forward completions (a module's children
finish before it, its inputs' producers before them), max |x|, RMS and the number of non-finite values of its outputs (forward) and of
the gradients arriving at those outputs (backward), and the squared norm of its parameters' gradients
before the data-parallel reduction (its share of this rank's gradient norm). MoE expert modules get one
row per expert (``<experts>.expert_<global id>``), their outputs split by ``tokens_per_expert``; routers
give the tokens routed to each expert. Statistics only read tensors: a replay with them on stays bitwise
equal to the original (the replay verifies it).

Backward uses tensor hooks on module outputs, as ``trace.hooks`` does (full module backward hooks
break in-place ops on outputs).
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.rundir import stats_path
from megatron_bitdet.trace.digest import trace_tensors

FORMAT = "bitdet-module-stats"
VERSION = 1
STATS = ("out_max", "out_rms", "out_nonfinite", "grad_max", "grad_rms", "grad_nonfinite", "param_grad_sq", "order")


class _Acc:
    """max |x|, sum of squares, element count and non-finite count, over every tensor seen."""

    __slots__ = ("max", "sq", "n", "nonfinite")

    def __init__(self):
        self.max, self.sq, self.n, self.nonfinite = 0.0, 0.0, 0, 0

    def add(self, t: torch.Tensor) -> None:
        if not t.is_floating_point() or t.numel() == 0:
            return
        t = t.detach()
        finite = torch.isfinite(t)
        self.nonfinite += int(t.numel() - finite.sum())
        self.max = max(self.max, float(t.abs().amax()))
        self.sq += float(t.double().square().sum())
        self.n += t.numel()

    def out(self, prefix: str) -> dict:
        rms = math.sqrt(self.sq / self.n) if self.n else 0.0
        return {f"{prefix}_max": self.max, f"{prefix}_rms": rms, f"{prefix}_nonfinite": self.nonfinite}


def _grad_sq(params) -> float:
    total = 0.0
    for p in params:
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is not None:
            total += float(g.detach().double().square().sum())
    return total


def _is_experts(mod) -> bool:
    """megatron's expert containers (SequentialMLP and subclasses such as bitdet's GroupedProbMLP)."""
    return hasattr(mod, "local_experts") and hasattr(mod, "num_local_experts")


def _is_router(mod) -> bool:
    from megatron.core.transformer.moe.router import Router

    return isinstance(mod, Router)


def _split_rows(t: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, counts)) if t.dim() and sum(counts) == t.shape[0] else []


class ModuleStats:
    """Collects one step's statistics for the named modules of this rank's model chunks."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]], roots: list[str], expert_offset: int = 0):
        self.modules = modules
        self.roots = roots  # the chunks' top-level names: their parameters are all of this rank's
        self.expert_offset = expert_offset  # global id of this rank's first local expert
        self._handles: list = []
        self.fwd: dict[str, _Acc] = {}
        self.bwd: dict[str, _Acc] = {}
        self.routed: dict[str, list[int]] = {}
        self.param_sq: dict[str, float] = {}
        self.total_sq = 0.0
        self.ran: set[str] = set()       # modules whose own forward ran (SequentialMLP's experts do)
        self.order: dict[str, int] = {}  # first forward completion in the step

    @classmethod
    def for_chunks(cls, chunks, expert_offset: int = 0) -> ModuleStats:
        """Named like the tracer names them, except that ``local_experts.<i>`` becomes ``expert_<global id>``
        (local index i means another expert on every expert-parallel rank)."""
        multi = len(chunks) > 1
        named = [(".".join(p for p in (f"chunk{i}" if multi else "", n) if p) or "model", m)
                 for i, chunk in enumerate(chunks) for n, m in chunk.named_modules()]
        named = [(re.sub(r"\.local_experts\.(\d+)(?=\.|$)", lambda g: f".expert_{expert_offset + int(g.group(1))}", n), m)
                 for n, m in named]
        return cls(named, ["chunk%d" % i if multi else "model" for i in range(len(chunks))], expert_offset)

    def expert_name(self, experts_path: str, local: int) -> str:
        return f"{experts_path}.expert_{self.expert_offset + local}"

    def begin(self) -> None:
        self.fwd, self.bwd, self.routed, self.param_sq, self.total_sq = {}, {}, {}, {}, 0.0
        self.ran, self.order = set(), {}
        for name, mod in self.modules:
            self._handles.append(mod.register_forward_hook(self._forward(name, mod), with_kwargs=True))

    def _forward(self, name: str, mod):
        experts, router = _is_experts(mod), _is_router(mod)

        def hook(module, args, kwargs, output):
            outs = trace_tensors(output)
            self.ran.add(name)
            self.order.setdefault(name, len(self.order))
            acc = self.fwd.setdefault(name, _Acc())
            for t in outs:
                acc.add(t)
            per_expert = None
            if experts and outs:
                tpe = args[1] if len(args) > 1 else kwargs.get("tokens_per_expert")
                per_expert = [int(c) for c in (tpe.tolist() if isinstance(tpe, torch.Tensor) else tpe)]
                if self.expert_name(name, 0) in self.ran:
                    per_expert = None  # the experts' own hooks saw their outputs
                for i, part in enumerate(_split_rows(outs[0], per_expert or [])):
                    self.order.setdefault(self.expert_name(name, i), self.order[name])
                    self.fwd.setdefault(self.expert_name(name, i), _Acc()).add(part)
            if router and len(outs) >= 2 and outs[1].dtype == torch.bool:
                load = outs[1].sum(dim=0).tolist()
                have = self.routed.setdefault(name, [0] * len(load))
                self.routed[name] = [a + int(b) for a, b in zip(have, load)]
            if torch.is_grad_enabled():
                for k, t in enumerate(outs):
                    if t.requires_grad:
                        t.register_hook(self._backward(name, per_expert if k == 0 else None))
        return hook

    def _backward(self, name: str, expert_counts):
        def hook(grad):
            if grad is None:
                return
            self.bwd.setdefault(name, _Acc()).add(grad)
            if expert_counts:
                for i, part in enumerate(_split_rows(grad, expert_counts)):
                    self.bwd.setdefault(self.expert_name(name, i), _Acc()).add(part)
        return hook

    def grads_ready(self) -> None:
        """Call once the step's gradients are accumulated, before their data-parallel reduction."""
        for name, mod in self.modules:
            self.param_sq[name] = _grad_sq(mod.parameters())
        self.total_sq = sum(self.param_sq[n] for n in self.roots)

    def end(self) -> dict:
        """Remove the hooks; this step's record: {"modules": {name: stats}, "routers": {name: counts}}."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        rows = {}
        for name in dict.fromkeys([*self.fwd, *self.bwd, *self.param_sq]):
            row = {}
            if name in self.fwd:
                row.update(self.fwd[name].out("out"))
            if name in self.bwd:
                row.update(self.bwd[name].out("grad"))
            if name in self.param_sq:
                row["param_grad_sq"] = self.param_sq[name]
            if name in self.order:
                row["order"] = self.order[name]
            rows[name] = row
        return {"modules": rows, "routers": self.routed, "total_grad_sq": self.total_sq}


class StatsWriter:
    """RUN_DIR/stats/rank_XXXXX.stats.jsonl: a header line, then one whole, flushed line per step."""

    def __init__(self, run_dir, rank: int, header: dict):
        path = stats_path(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "w", encoding="utf-8")
        self._write({"format": FORMAT, "v": VERSION, "rank": rank, **header})

    def _write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._f.flush()

    def write(self, step: int, record: dict) -> None:
        self._write({"step": step, **record})

    def close(self) -> None:
        if not self._f.closed:
            os.fsync(self._f.fileno())
            self._f.close()


def read_stats(path: Path) -> dict[int, dict]:
    """{step: record} of one rank's stats file; any defect names the file and line (exit 2)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BitdetInputError(f"{path}: cannot read module statistics ({exc.strerror})") from None
    if not data:
        raise BitdetInputError(f"{path}: empty module-stats file")
    lines = data.split(b"\n")
    if not data.endswith(b"\n"):
        raise BitdetInputError(f"{path}:{len(lines)}: truncated final line (the writer stopped mid-line)")
    out: dict[int, dict] = {}
    for no, raw in enumerate(lines[:-1], start=1):
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):  # UnicodeDecodeError and over-long integers included
            raise BitdetInputError(f"{path}:{no}: not JSON") from None
        if no == 1:
            if not isinstance(obj, dict) or obj.get("format") != FORMAT:
                raise BitdetInputError(f"{path}:1: foreign file (no '{FORMAT}' header)")
            if obj.get("v") != VERSION:
                raise BitdetInputError(f"{path}:1: module-stats format version {obj.get('v')!r}, expected {VERSION}")
            continue
        if (not isinstance(obj, dict) or not isinstance(obj.get("step"), int)
                or not isinstance(obj.get("modules"), dict) or not isinstance(obj.get("routers"), dict)
                or not isinstance(obj.get("total_grad_sq"), (int, float))):
            raise BitdetInputError(f"{path}:{no}: not a module-stats record (needs step, modules, routers, "
                                   "total_grad_sq)")
        for name, row in obj["modules"].items():
            bad = [k for k, v in row.items() if k not in STATS or not isinstance(v, (int, float))] \
                if isinstance(row, dict) else ["(not an object)"]
            if bad:
                raise BitdetInputError(f"{path}:{no}: module {name!r}: bad statistic(s) {', '.join(bad)}")
        out[obj["step"]] = obj
    if not out:
        raise BitdetInputError(f"{path}: no module-stats records")
    return out
