"""Module check: build a module with your builder under several megatron parallel layouts (spawned
ranks: gloo on CPU, nccl on GPU), repeat forward + backward with every RNG restored, and compare
outputs and gradients byte for byte across repeats on every rank."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.testing.core import CheckReport, NondeterminismError, child_import_env

RANK_WORKER = "megatron_bitdet.testing.module:module_rank"


@dataclass(frozen=True)
class Layout:
    """One megatron parallel layout; ``builder(layout)`` reads it to size the module."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    expert_tensor: Optional[int] = None
    sequence_parallel: bool = False

    def __str__(self) -> str:
        text = f"tp{self.tensor} pp{self.pipeline} cp{self.context} ep{self.expert}"
        if self.expert_tensor is not None:
            text += f" etp{self.expert_tensor}"
        return text + (" sp" if self.sequence_parallel else "")

    def transformer_config(self, **kwargs):
        """A megatron ``TransformerConfig`` with this layout's parallel sizes, megatron's
        ``deterministic_mode`` and CPU initialization on a CPU-only torch; ``kwargs`` add or override."""
        import torch
        from megatron.core.transformer.transformer_config import TransformerConfig

        base = dict(tensor_model_parallel_size=self.tensor, pipeline_model_parallel_size=self.pipeline,
                    context_parallel_size=self.context, expert_model_parallel_size=self.expert,
                    expert_tensor_parallel_size=self.expert_tensor, sequence_parallel=self.sequence_parallel,
                    deterministic_mode=True, use_cpu_initialization=not torch.cuda.is_available())
        return TransformerConfig(**{**base, **kwargs})


def _layout(value) -> Layout:
    if isinstance(value, Layout):
        return value
    if isinstance(value, dict):
        unknown = set(value) - set(Layout.__dataclass_fields__)
        if unknown:
            raise BitdetInputError(f"layout {value}: unknown key(s) {sorted(unknown)}; known: "
                                   f"{sorted(Layout.__dataclass_fields__)}")
        return Layout(**value)
    raise BitdetInputError(f"a layout is a Layout or a dict like {{'tensor': 2}}, got {value!r}")


def _builder_path(builder) -> str:
    if isinstance(builder, str):
        return builder
    module, qualname = getattr(builder, "__module__", None), getattr(builder, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname or "." in qualname:
        raise BitdetInputError(f"builder {builder!r} must be a module-level function of an importable module "
                               "(or a 'package.module:function' string): every rank imports it afresh")
    return f"{module}:{qualname}"


def check_module(builder, *, layouts: Sequence = (Layout(),), world_size: int = 2, repeats: int = 3,
                 threads: Optional[Iterable[int]] = None, seed: int = 1234, deterministic_algorithms: bool = True,
                 backward: bool = True, workdir=None) -> CheckReport:
    """On ``world_size`` spawned ranks, for every layout: initialize megatron's parallel state, seed
    (torch, random, numpy, megatron's tracker), then ``repeats`` times restore every RNG, call
    ``builder(layout)`` -> ``(module, inputs)``, run ``module(*inputs)`` forward and backward with
    fixed cotangents, and compare outputs, input gradients and parameter gradients byte for byte with
    the first repeat. Raises :class:`NondeterminismError` naming layout, rank, tensor and first
    differing element. Layouts are not compared with each other (sharding changes the bits).
    ``builder`` is a module-level function or a 'package.module:function' string (ranks import it)."""
    from megatron_bitdet.train.launch import launch

    __tracebackhide__ = True  # pytest shows the message, not these frames
    if repeats < 2:
        raise ValueError("repeats must be >= 2: one run proves nothing")
    path = _builder_path(builder)
    layouts = [_layout(v) for v in layouts]
    if not layouts:
        raise BitdetInputError("check_module needs at least one layout")
    with tempfile.TemporaryDirectory(prefix="bitdet_module_check_") as scratch:
        out = Path(workdir) if workdir is not None else Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob("rank_*.json"):  # only this launch's verdicts count
            stale.unlink()
        args = {"builder": path, "layouts": [asdict(l) for l in layouts], "repeats": repeats, "seed": seed,
                "threads": None if threads is None else list(threads), "backward": backward,
                "deterministic_algorithms": deterministic_algorithms, "out": str(out)}
        rc = launch(RANK_WORKER, world_size, args, run_dir=out, env=child_import_env())
        results = {}
        for rank in range(world_size):
            f = out / f"rank_{rank:05d}.json"
            if f.exists():
                results[rank] = json.loads(f.read_text())
        return _verdict(f"check_module({path})", repeats, world_size, rc, results, out, deterministic_algorithms)


def _verdict(subject, repeats, world, rc, results, out, deterministic) -> CheckReport:
    errors = [(r, res["error"]) for r, res in sorted(results.items()) if res.get("error")]
    if errors:
        rank, error = errors[0]
        raise BitdetError(f"{subject}: rank {rank} failed {error}")
    if rc != 0 or len(results) != world:
        raise BitdetError(f"{subject}: the ranks failed (exit {rc}) before reporting; logs: {out / 'logs'}")
    failures = [(rank, f) for rank, res in sorted(results.items()) for f in res["failures"]]
    if failures:
        lines = [f"{subject} is not bitwise repeatable (world size {world}, RNG restored before every repeat):"]
        for rank, f in failures[:6]:
            lines.append(f"  layout {f['layout']}, rank {rank}, threads={f['threads']}: repeat {f['repeat']} of "
                         f"{repeats} differs from repeat 0 in {len(f['differences'])} tensor(s):")
            lines += [f"    {d}" for d in f["differences"][:6]]
        if len(failures) > 6:
            lines.append(f"  ... {len(failures) - 6} more (layout, rank) failures")
        lines.append("  next: check the ops of the first differing tensor with check_kernel (threads=(1, N)), or "
                     "trace them in training: bitdet train ... --trace op, then bitdet localize A B")
        if not deterministic:
            lines.append("  note: torch's deterministic algorithms were off (deterministic_algorithms=False)")
        raise NondeterminismError("\n".join(lines), failures)
    first = results[0]
    settings = [s for res in results.values() for s in res["settings"]]
    threads = max(res.get("max_threads", 1) for res in results.values())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    notes = [f"{world} ranks x {threads} threads ran on {cores} core(s): threads that never overlap hide a source "
             "bound to thread timing (atomic-style adds), so these repeats may not show one; check on idle cores "
             "with more repeats"] if threads > 1 and world * threads > cores else []
    return CheckReport(subject, repeats, settings, first["tensors"], sum(r["elements"] for r in results.values()),
                       notes)


def module_rank(rank: int, world: int, *, builder, layouts, repeats, seed, threads, backward,
                deterministic_algorithms, out) -> int:
    """One rank of check_module: every layout x thread count, repeats compared in this process."""
    import torch

    from megatron_bitdet.compat.cpu_backend import install
    from megatron_bitdet.testing.core import RngState, compare, elements, run_once
    from megatron_bitdet.train.launch import resolve_worker
    from megatron_bitdet.train.setup import set_seeds

    result = {"settings": [], "failures": [], "tensors": [], "elements": 0}
    path = Path(out) / f"rank_{rank:05d}.json"
    current = "before any layout"
    try:
        install()
        from megatron.core import parallel_state as ps

        fn = resolve_worker(builder)
        torch.use_deterministic_algorithms(deterministic_algorithms)
        for spec in layouts:
            layout = Layout(**spec)
            current = f"under layout {layout}"
            ps.initialize_model_parallel(
                tensor_model_parallel_size=layout.tensor, pipeline_model_parallel_size=layout.pipeline,
                context_parallel_size=layout.context, expert_model_parallel_size=layout.expert,
                expert_tensor_parallel_size=layout.expert_tensor)
            for count in threads or [torch.get_num_threads()]:
                torch.set_num_threads(count)
                result["max_threads"] = max(result.get("max_threads", 1), count)
                set_seeds(seed)
                rng, runs = RngState(), []
                for _ in range(repeats):
                    rng.restore()
                    built = fn(layout)
                    if not (isinstance(built, tuple) and len(built) == 2 and callable(built[0])):
                        raise BitdetInputError(f"the builder must return (module, inputs), got {type(built).__name__}")
                    module, inputs = built
                    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
                    runs.append(run_once(module, inputs, backward=backward))
                setting = f"layout {layout}, rank {rank}, threads={count}"
                result["settings"].append(setting)
                result["tensors"], result["elements"] = list(runs[0]), result["elements"] + elements(runs[0])
                for k, run in enumerate(runs[1:], start=1):
                    diffs = compare(runs[0], run)
                    if diffs:
                        result["failures"].append({"layout": str(layout), "threads": count, "repeat": k,
                                                   "differences": [str(d) for d in diffs]})
                        break
            ps.destroy_model_parallel()
    except Exception as exc:  # reported by the parent with the layout; the launcher stops the peers
        result["error"] = f"{current}: {type(exc).__name__}: {exc}"
        path.write_text(json.dumps(result))
        raise
    path.write_text(json.dumps(result))
    return 0
