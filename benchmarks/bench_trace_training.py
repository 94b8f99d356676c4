"""Tracing overhead inside real training: the default recipe's step untraced vs semantic-, module- and
op-level tracing (goals: module <= 1.1x, op <= 2x, stretch 1.5x; semantic, every level's floor, shows
what the collectives and events cost before any hook).

ONE 2-rank launch builds the model once; each round runs one real training step (``train_steps``,
fingerprints included) per configuration, each timed after a barrier; a round's time is the slowest
rank's. Ratios are paired medians over rounds (each round's traced / untraced), so machine drift
cancels. The training state advances through every step alike. The order is shuffled every round (one
seed, the same on every rank): what a step leaves behind (caches, the allocator's free lists after the
op level's 200 MiB of hashing) then lands on every configuration alike, where a fixed alternation (A B C,
C B A) had the module level follow the op level in half the rounds and the untraced step never. Every
step starts after an untimed ``gc.collect()`` for the same reason (one configuration's garbage would
trigger a collection in the next step). Per-step times on this 2-core machine spread by ±20% (two ranks
and their OpenMP threads share the cores): the paired median of 12 rounds moves by ±5% between runs,
of 100 (the default) still by ±5%. So each ratio comes with a 95% bootstrap interval, and a goal reads
"ok" only when the whole interval meets it ("MISSED" when none of it does, else "inconclusive").
CPU time (both ranks' processes, every thread) is printed beside wall time: on a shared machine it moves
less with other load; so is the main threads' CPU time (``time.thread_time``: the work the tracer adds to
the thread that runs it, without the OpenMP workers' spinning), as extra milliseconds a step and rank.
The 1-minute load average is printed with the figures.
"Outside the window" (nothing installed) is checked by tests/test_trace_training.py, not timed here.

    .venv/bin/python benchmarks/bench_trace_training.py [--rounds 100] [--warmup 3] [--profile [LEVEL]] [--shape large]

``--profile`` also prints rank 0's cProfile top functions of one step traced at LEVEL (default op).
``--shape large`` runs the larger model of ``benchmarks/shapes.py`` (hidden 256, seq 256): how the
overhead scales with the model, where the goals (printed for the default shape only) are the default
recipe's.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.intervals import MIN_ROUNDS, median_interval, paired_ratios, verdict  # noqa: E402

CONFIGS = ("untraced", "semantic", "module", "op")
GOALS = {"module": 1.1, "op": 2.0}


_DTYPE_BYTES = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2,
                "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8}


def trace_volume(run_dir: Path, rank: int) -> dict:
    """Records and tensor bytes digested per traced step, read back from this rank's op trace."""
    from megatron_bitdet.trace import trace_path

    steps, records, nbytes = set(), 0, 0
    with open(trace_path(run_dir, rank)) as f:
        next(f)
        for line in f:
            rec = json.loads(line)
            steps.add(rec["step"])
            records += 1
            for d in rec["in"] + rec["out"]:
                dtype, _, shape = d.partition("[")
                numel = 1
                for n in shape.split("]")[0].split(","):
                    numel *= int(n) if n else 1
                nbytes += numel * _DTYPE_BYTES.get(dtype, 4)
    return {"records_per_step": records / len(steps), "bytes_per_step": nbytes / len(steps)}


def digest_costs() -> dict:
    """Marginal cost of tracing one op on tiny tensors (us) and of digesting one byte (ns) through the
    tracer's own digests (``Tracer.fps``: the native ones where the native tracer is built), in process;
    and which op tracer ran."""
    import torch

    from megatron_bitdet.trace import Tracer

    torch.set_num_threads(2)
    x = torch.ones(4)
    big = torch.rand(1 << 24)
    with tempfile.TemporaryDirectory() as tmp:
        tr = Tracer(tmp, 0, 1, level="op")
        n = 2000

        def ops():
            t0 = time.perf_counter()
            for _ in range(n):
                x.add(1.0)
            return time.perf_counter() - t0
        plain, traced, per_byte = [], [], []
        for _ in range(7):
            plain.append(ops())
            with tr.step(1):
                traced.append(ops())
            t0 = time.perf_counter()
            tr.fps([big])
            per_byte.append((time.perf_counter() - t0) / big.nbytes)
        tr.close()
    return {"us_per_op": statistics.median(t - p for t, p in zip(traced, plain)) / n * 1e6,
            "ns_per_byte": statistics.median(per_byte) * 1e9, "op_tracer": tr.op_tracer}


def worker(rank: int, world_size: int, *, recipe: dict, out: str, rounds: int, warmup: int, profile: str | None) -> int:
    import gc

    import torch
    from megatron.core import parallel_state as ps

    from megatron_bitdet.fingerprint.steps import StepFingerprintWriter
    from megatron_bitdet.model.builder import load_model_provider
    from megatron_bitdet.train.console import Console
    from megatron_bitdet.train.data import build_train_data
    from megatron_bitdet.train.loop import train_steps
    from megatron_bitdet.train.setup import setup
    from megatron_bitdet.trace import Tracer

    recipe_obj, enforcement = _ENFORCED["recipe"], _ENFORCED["enforcement"]
    state = setup(recipe_obj, enforcement, provider=load_model_provider(None))
    t = recipe_obj.training
    steps = (warmup + rounds) * len(CONFIGS) + (1 if profile else 0)
    data = build_train_data(
        recipe_obj.data, seq_length=recipe_obj.model.seq_length, seed=t.seed, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(), train_samples=steps * t.global_batch_size,
    )
    tmp = Path(out).parent
    tracers = {"untraced": None}
    for level in CONFIGS[1:]:
        tracers[level] = Tracer(tmp / level, rank, world_size, level=level)
        tracers[level].attach([m.module for m in state.ddp_modules])
    console = Console(active=False, total=steps)
    writer = StepFingerprintWriter(tmp / "run", rank)  # one for the run, as in training (fsync'd once, at close)
    times = {c: [] for c in CONFIGS}
    cpu = {c: [] for c in CONFIGS}
    main_cpu = {c: [] for c in CONFIGS}
    step = 0

    def one(config):
        nonlocal step
        gc.collect()  # untimed: no step inherits the previous one's garbage
        torch.distributed.barrier()
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        train_steps(state, data, run_dir=tmp / "run", start=step, stop=step + 1, save_root=None, save_interval=0,
                    manifest={}, console=console, tracer=tracers[config], writer=writer)
        step += 1
        return time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - m0

    order = random.Random(0)
    for r in range(warmup + rounds):
        for config in order.sample(CONFIGS, len(CONFIGS)):
            s, c, m = one(config)
            if r >= warmup:
                times[config].append(s)
                cpu[config].append(c)
                main_cpu[config].append(m)
    if profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        one(profile)
        prof.disable()
        if rank == 0:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            print(buf.getvalue(), flush=True)
    writer.close()
    for tr in tracers.values():
        if tr is not None:
            tr.close()
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, {"wall": times, "cpu": cpu, "main": main_cpu})
    if rank == 0:
        Path(out).write_text(json.dumps({"times": gathered, "volume": {level: trace_volume(tmp / level, rank)
                                                                        for level in ("module", "op")}}))
    torch.distributed.barrier()
    ps.destroy_model_parallel()
    return 0


def _enforce(rank: int, world_size: int, *, recipe: dict, **_unused) -> None:
    """The recipe's enforcement, before the process group exists (as ``bitdet train`` does)."""
    import warnings

    from megatron_bitdet.enforce import enable
    from megatron_bitdet.recipe import Recipe

    warnings.simplefilter("ignore")
    r = Recipe.from_dict(recipe, source="<bench recipe>")
    _ENFORCED.update(recipe=r, enforcement=enable(r, rank=rank, world_size=world_size))


_ENFORCED: dict = {}
worker.before_process_group = _enforce


class Measured(NamedTuple):
    """One launch's figures, each a list per configuration over rounds."""

    wall: dict          # step ms, the slowest rank's
    cpu: dict           # CPU ms, every rank's process together
    main: list          # per rank: its main thread's CPU ms
    volume: dict        # level (module, op) -> trace_volume of rank 0's trace


def measure(recipe, *, nproc: int, rounds: int, warmup: int, profile: str | None = None) -> Measured:
    """Each configuration's figures per round, from one launch of ``nproc`` ranks."""
    from megatron_bitdet.train.run import child_env
    from megatron_bitdet.train.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        env = {**child_env(recipe), "PYTHONPATH": str(ROOT)}
        rc = launch("benchmarks.bench_trace_training:worker", nproc,
                    {"recipe": recipe.to_dict(), "out": str(out), "rounds": rounds, "warmup": warmup,
                     "profile": profile}, run_dir=Path(tmp) / "launch", env=env)
        if rc != 0:
            raise SystemExit(f"benchmark launch failed (exit {rc})")
        data = json.loads(out.read_text())
    ranks = [r["wall"] for r in data["times"]]
    per_round = {c: [max(r[c][i] for r in ranks) * 1000 for i in range(rounds)] for c in CONFIGS}
    cpu = {c: [sum(r["cpu"][c][i] for r in data["times"]) * 1000 for i in range(rounds)] for c in CONFIGS}
    main_cpu = [{c: [x * 1000 for x in r["main"][c]] for c in CONFIGS} for r in data["times"]]
    return Measured(per_round, cpu, main_cpu, data["volume"])


def paired_ratio(per_round: dict, config: str) -> float:
    """The median over rounds of each round's traced / untraced."""
    return statistics.median(paired_ratios(per_round[config], per_round["untraced"]))


def ratio_interval(per_round: dict, config: str) -> tuple[float, float]:
    """``paired_ratio``'s 95% bootstrap interval."""
    return median_interval(paired_ratios(per_round[config], per_round["untraced"]))


def main() -> None:
    from benchmarks.shapes import SHAPES
    from megatron_bitdet.recipe import load_recipe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100, help=f"at least 2; a goal's verdict needs >= {MIN_ROUNDS}")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", nargs="?", const="op", choices=("module", "op"), default=None,
                    help="also profile one step traced at this level (default op)")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="default")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (a spread needs two rounds)")
    recipe = load_recipe(ROOT / "recipes" / "nemotron_h_tiny.yaml", SHAPES[args.shape])
    load0 = os.getloadavg()[0]
    per_round, cpu, main_cpu, volume = measure(recipe, nproc=2, rounds=args.rounds, warmup=args.warmup,
                                               profile=args.profile)
    costs = digest_costs()
    load1 = os.getloadavg()[0]
    m = recipe.model
    print(f"\nstep time, {args.shape} shape (hidden {m.hidden_size}, seq {m.seq_length}), 2 ranks, {args.rounds} "
          f"rounds (order shuffled) after {args.warmup} warm-up (slowest rank per round):")
    print(f"  {'config':<10} {'p10 ms':>8} {'p50 ms':>8} {'p90 ms':>8} {'paired ratio':>13} {'95% interval':>15}")
    for c in CONFIGS:
        xs = sorted(per_round[c])
        q = statistics.quantiles(xs, n=10)
        ratio, (lo, hi) = paired_ratio(per_round, c), ratio_interval(per_round, c)
        goal = GOALS.get(c) if args.shape == "default" else None
        mark = "" if goal is None else f"  (goal <= {goal:.1f}x: {verdict(ratio, (lo, hi), goal, args.rounds)})"
        print(f"  {c:<10} {q[0]:8.1f} {statistics.median(xs):8.1f} {q[-1]:8.1f} {ratio:12.2f}x {lo:6.2f}-{hi:.2f}x{mark}")
    print(f"CPU time per step, both ranks' processes together (less sensitive to other load than wall time):")
    for c in CONFIGS:
        print(f"  {c:<10} {statistics.median(cpu[c]):8.1f} ms {paired_ratio(cpu, c):12.2f}x")
    print("main-thread CPU per step and rank (the tracer's own work; paired extra over the untraced step):")
    for c in CONFIGS:
        extras = [statistics.median(x - b for x, b in zip(r[c], r["untraced"])) for r in main_cpu]
        print(f"  {c:<10} " + "  ".join(f"rank {i}: {statistics.median(r[c]):6.1f} ms ({e:+.2f} ms, "
                                        f"{paired_ratio(r, c):.3f}x)"
                                        for i, (r, e) in enumerate(zip(main_cpu, extras))))
    for level in ("module", "op"):
        records, mib = volume[level]["records_per_step"], volume[level]["bytes_per_step"] / 2**20
        extra = statistics.median(o - b for o, b in zip(per_round[level], per_round["untraced"]))
        print(f"{level} trace, rank 0: {records:.0f} records and {mib:.1f} MiB of tensors digested per step; "
              f"paired extra {extra:.1f} ms = {extra * 1000 / records:.1f} us per record")
    print(f"in process ({costs['op_tracer']} op tracer): {costs['us_per_op']:.1f} us per traced op on tiny tensors, "
          f"{costs['ns_per_byte']:.3f} ns per digested byte ({1 / costs['ns_per_byte']:.1f} GB/s)")
    print(f"1-minute load average: {load0:.2f} at the start, {load1:.2f} at the end")


if __name__ == "__main__":
    main()
