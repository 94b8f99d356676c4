"""One rank of ``bitdet tax``: build every configuration side by side, then alternate their steps.

Each rank builds the deterministic model and every nondeterministic candidate in ONE process (same
parallel state, same seeds, same batches), so machine drift, thermal state and the launch itself
cancel out. Before each step the side's process state is put in place: its patch set (setattr,
cheap) and ``torch.use_deterministic_algorithms``. Process-wide env vars (the canonical determinism
environment) are set once, before torch starts, and therefore apply to every side alike; on CPU they
change nothing that runs here.
"""
from __future__ import annotations

import functools
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_bitdet.train.worker import enforce

# Op name fragments -> op group, first match wins (self CPU/device time of each op); a fragment
# ending in "$" must match the whole name ("aten::exp$" is not aten::expand).
OP_GROUPS = (
    ("communication", ("c10d::", "gloo", "nccl", "all_reduce", "alltoall", "allgather", "all_gather",
                       "reduce_scatter", "reducescatter", "gatherfrom", "scatterto", "reducefrom", "copyto",
                       "broadcast")),
    ("compiled (inductor)", ("compiledfxgraph", "torch-compiled", "compiled")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "matmul", "linear", "einsum", "_grouped_mm",
                "aten::baddbmm")),
    ("attention", ("softmax", "scaled_dot_product", "flash", "attention")),
    ("ssm scan / conv", ("cumsum", "conv", "segsum", "aten::exp$", "softplus", "tril")),
    ("moe permute / index", ("index", "scatter", "gather", "sort", "topk", "nonzero", "masked", "bincount",
                             "histc", "embedding", "where", "permute")),
    ("norms", ("norm", "rsqrt", "aten::pow", "aten::mean", "aten::var")),
    ("optimizer", ("_foreach", "adam", "lerp", "addcdiv", "addcmul", "aten::sqrt")),
    ("fill / copy", ("fill_", "zero_", "copy_", "clone", "empty", "aten::cat", "aten::stack", "contiguous")),
)
TOP_OPS = 12
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single", "broadcast",
               "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_gather_object")


def op_group(name: str) -> str:
    low = name.lower()
    for group, keys in OP_GROUPS:
        if any(low == k[:-1] if k.endswith("$") else k in low for k in keys):
            return group
    return "other"


@dataclass
class Side:
    """One configuration: its recipe, the patches it runs with, and its own model/optimizer/data."""

    name: str
    recipe: object
    patches: list
    deterministic: bool
    swaps: list = field(default_factory=list)  # the enforcement's resolved swaps (deterministic side only)
    fill: bool = False  # torch.utils.deterministic.fill_uninitialized_memory during its steps
    upstream_mode: bool = False  # megatron's own deterministic mode of the installed version sets torch's flag
    state: object = None
    data: object = None
    step_s: list = field(default_factory=list)
    comm_s: list = field(default_factory=list)
    peak_mib: list = field(default_factory=list)
    det_flag_seen: set = field(default_factory=set)
    invariant_seen: set = field(default_factory=set)  # were topology-invariant reductions bound in its steps
    op_groups_ms: dict = field(default_factory=dict)
    top_ops_ms: dict = field(default_factory=dict)
    op_calls: dict = field(default_factory=dict)  # calls per step of every op (load-independent, unlike times)


class CommTimer:
    """Wall time spent inside torch.distributed collectives (call + blocking wait of async work)."""

    def __init__(self):
        self.seconds = 0.0

    def _wrap(self, fn):
        timer = self

        class _Work:
            def __init__(self, work):
                self._work = work

            def wait(self, *a, **k):
                t0 = time.perf_counter()
                try:
                    return self._work.wait(*a, **k)
                finally:
                    timer.seconds += time.perf_counter() - t0

            def __getattr__(self, name):
                return getattr(self._work, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                res = fn(*args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - t0
            if isinstance(res, list) and res and hasattr(res[0], "wait"):
                return [_Work(w) for w in res]
            return _Work(res) if hasattr(res, "wait") else res
        return wrapper

    @contextmanager
    def installed(self):
        """Swap the collectives in torch.distributed and in every megatron module alias of them."""
        from megatron_bitdet.compat.collectives import swap_collectives

        with swap_collectives(lambda _name, fn: self._wrap(fn), COLLECTIVES):
            yield self


class PeakMemory:
    """Peak memory of one step: CUDA allocator peak, or on CPU the process RSS high-water mark
    (VmHWM, reset before the step through /proc/self/clear_refs). RSS includes every side's resident
    model and the allocator's cached pages, so compare sides by difference, not by absolute value."""

    def reset(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass

    def peak_mib(self) -> float:
        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**20
        import resource

        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_DEFAULT_THREADS: list = []


def _activate(side: Side) -> None:
    """Make this process run ``side``: its exact patch set, torch's deterministic-algorithms flag (or
    upstream's deterministic mode, ``compat.upstream_determinism``) and its thread count (a deterministic
    recipe's determinism.threads, else torch's default)."""
    from megatron_bitdet.compat import upstream_determinism
    from megatron_bitdet.compat.patching import applied_patches, apply_patches, load_declarations, revert_patches

    have = [p["id"] for p in applied_patches()]
    extra = [i for i in have if i not in side.patches]
    if extra:
        revert_patches(extra)
    missing = [i for i in side.patches if i not in have]
    if missing:
        apply_patches(load_declarations(ids=missing))
    if side.upstream_mode:
        upstream_determinism.apply(side.recipe)
    else:
        torch.use_deterministic_algorithms(side.deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = side.fill
    det = side.recipe.determinism
    torch.set_num_threads(det.threads if det.mode and det.threads is not None else _DEFAULT_THREADS[0])


def _build(side: Side, provider) -> None:
    from megatron.core import parallel_state as ps

    from megatron_bitdet.train.data import build_train_data
    from megatron_bitdet.train.setup import build_trainable

    _activate(side)
    side.state = build_trainable(side.recipe, swaps=side.swaps, provider=provider, patches=side.patches)
    t = side.recipe.training
    side.data = build_train_data(
        side.recipe.data, seq_length=side.recipe.model.seq_length, seed=t.seed, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(), train_samples=t.iterations * t.global_batch_size,
        virtual_dp=side.recipe.determinism.virtual_dp,
    )


def _step(side: Side) -> None:
    """The training loop's step (``train.loop.train_step``), minus fingerprints and checkpoints."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron_bitdet.compat import moe_tracker
    from megatron_bitdet.train.loop import train_step

    train_step(side.state, side.data, get_forward_backward_func())
    side.det_flag_seen.add(torch.are_deterministic_algorithms_enabled())
    moe_tracker.clear()


def _timed_step(side: Side, comm: CommTimer, memory: PeakMemory, record: bool) -> None:
    from megatron_bitdet.train.reductions import active

    _activate(side)
    memory.reset()
    comm.seconds = 0.0
    with active(side.recipe.determinism.reductions) as bindings:  # rebinding happens outside the clock
        side.invariant_seen.add(bool(bindings))
        dist.barrier()  # every side pays the barrier before its clock starts
        t0 = time.perf_counter()
        with comm.installed():
            _step(side)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    if record:
        side.step_s.append(elapsed)
        side.comm_s.append(comm.seconds)
        side.peak_mib.append(memory.peak_mib())


def _profile(sides: list, steps: int) -> None:
    """Self time per op group of each side, averaged over ``steps`` profiled steps (not part of the timed
    rounds). One profiler session per step, sides alternated A B .., .. B A like the rounds: profiling
    each side's steps back to back charged the first-profiled side up to 2x its op times."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_bitdet.train.reductions import active

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    ms: dict = {s.name: {} for s in sides}
    calls: dict = {s.name: {} for s in sides}
    for k in range(steps):
        for side in (sides if k % 2 == 0 else sides[::-1]):
            _activate(side)
            with active(side.recipe.determinism.reductions), profile(activities=activities) as prof:
                _step(side)
            for evt in prof.key_averages():
                t = evt.self_device_time_total if torch.cuda.is_available() else evt.self_cpu_time_total
                ms[side.name][evt.key] = ms[side.name].get(evt.key, 0.0) + t / 1000 / steps
                calls[side.name][evt.key] = calls[side.name].get(evt.key, 0) + evt.count / steps
    for side in sides:
        ops = ms[side.name]
        groups: dict = {}
        for key, v in ops.items():
            groups[op_group(key)] = groups.get(op_group(key), 0.0) + v
        side.op_groups_ms = {g: round(v, 3) for g, v in sorted(groups.items())}
        side.top_ops_ms = {k: round(v, 3) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:TOP_OPS]}
        side.op_calls = calls[side.name]


def tax_worker(rank: int, world_size: int, *, recipe: dict, sides: list, rounds: int, warmup: int,
               profile_steps: int, out_path: str, model_provider: str | None = None) -> int:
    """``sides``: [{"name", "recipe" (dict), "deterministic", "model_provider"?}], the deterministic one first."""
    from megatron.core import parallel_state as ps

    from megatron_bitdet.compat import cpu_backend
    from megatron_bitdet.model.builder import load_model_provider, resolve_spec_family
    from megatron_bitdet.compat.patching import select_patches
    from megatron_bitdet.recipe import Recipe
    from megatron_bitdet.train.setup import init_parallel
    from megatron_bitdet.train.worker import enforced

    cpu_backend.install()
    run_recipe, enforcement = enforced()
    init_parallel(run_recipe)
    _DEFAULT_THREADS[:] = [torch.get_num_threads()]
    built, providers = [], []
    for s in sides:
        r = Recipe.from_dict(s["recipe"], source=f"<tax {s['name']}>")
        swaps = list(enforcement.rules.swaps) if s.get("swaps", s["deterministic"]) else []
        patches = [p for p in select_patches(r, family=resolve_spec_family(r), swaps=swaps)
                   if p not in s.get("without_patches", ())]
        built.append(Side(s["name"], r, patches, s["deterministic"], swaps,
                          fill=s.get("fill_uninitialized_memory", run_recipe.determinism.fill_uninitialized_memory),
                          upstream_mode=s.get("upstream_mode", False)))
        providers.append(load_model_provider(s.get("model_provider", model_provider)))
    phases = {"start": time.perf_counter()}
    for side, provider in zip(built, providers):
        _build(side, provider)
    phases["built"] = time.perf_counter()
    comm, memory = CommTimer(), PeakMemory()
    for r in range(warmup + rounds):
        order = built if r % 2 == 0 else built[::-1]  # A B C, C B A, ...: no side always goes first
        for side in order:
            _timed_step(side, comm, memory, record=r >= warmup)
    phases["rounds"] = time.perf_counter()
    _profile(built, profile_steps)
    phases["profiled"] = time.perf_counter()
    mine = [{"name": s.name, "step_s": s.step_s, "comm_s": s.comm_s, "peak_mib": s.peak_mib,
             "det_flag_seen": sorted(s.det_flag_seen), "invariant_seen": sorted(s.invariant_seen), "op_groups_ms": s.op_groups_ms,
             "top_ops_ms": s.top_ops_ms, "op_calls": s.op_calls} for s in built]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"world_size": world_size, "threads": torch.get_num_threads(),
                                              "ranks": gathered, "phases_s": {
            k: round(phases[k] - phases["start"], 2) for k in phases if k != "start"}}))
    dist.barrier()
    ps.destroy_model_parallel()
    return 0


tax_worker.before_process_group = enforce
