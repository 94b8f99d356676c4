"""Cost of per-step fingerprinting as a fraction of a training step (target: <= 0.3%).

One rank process (started by bitdet's launcher with the run's determinism environment), a 1-rank
gloo world, the tiny hybrid recipe with ``parallel.expert=1`` (so one rank
holds every expert), set up exactly as ``bitdet train`` does. Each round runs one training step
(forward+backward over all micro-batches, optimizer, scheduler) and then the fingerprint work the
loop does for it (``StepDigests``: the grads' digests, then the state's: params, the model's
buffers, the generators it holds, the precision digests; then the digests read back and one JSON
line written and flushed; the writer fsyncs once, at close), timing both: interleaved by
construction, medians over the rounds.

    .venv/bin/python benchmarks/bench_fingerprint_overhead.py [--steps 30] [--warmup 3] [KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def enforce(rank: int, world_size: int, *, recipe: dict, **_unused) -> None:
    """Before the process group, as ``bitdet train``'s worker does (the launcher calls it); the
    (recipe, enforcement) pair lands in ``enforce.results``."""
    from megatron_bitdet.enforce import enable
    from megatron_bitdet.compat.patching import declared_ids
    from megatron_bitdet.recipe import Recipe

    recipe = Recipe.from_dict(recipe, source="<bench recipe>")
    enforce.results.append((recipe, enable(recipe, rank=rank, world_size=world_size, available_swaps=declared_ids())))


enforce.results = []


def build(recipe, enforcement):
    """setup -> data, in the worker's order (enforcement and process group already in place); the
    data of this rank's data-parallel slice."""
    from megatron.core import parallel_state as ps

    from megatron_bitdet.model.builder import default_model_provider
    from megatron_bitdet.train.data import build_train_data
    from megatron_bitdet.train.setup import setup

    state = setup(recipe, enforcement, provider=default_model_provider)
    t = recipe.training
    data = build_train_data(
        recipe.data, seq_length=recipe.model.seq_length, seed=t.seed, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size, dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(), train_samples=t.iterations * t.global_batch_size,
    )
    return state, data


def train_step(state, data, forward_backward) -> None:
    from megatron_bitdet.train.loop import train_step as loop_step

    loop_step(state, data, forward_backward)


def fingerprint(digests, writer, step: int) -> tuple[float, int]:
    """What the loop adds per step: the grads' digests (in training launched before the optimizer), the
    state's (``StepDigests.state``), then one line: the digests read back, the line written and
    flushed. Returns the time at which the digests were launched (the line reported apart) and the
    bytes the line's slices cover (this rank's share of the DDP buffers)."""
    digests.grads(step)
    digests.state(step)
    launched = time.perf_counter()
    line = writer.write(step, {"loss": 1.0, "lr": 0.001}, *digests.resolve())
    return launched, sum(hi - lo for rec in line["slices"] for lo, hi, _ in rec["parts"])


def bench_worker(rank: int, world_size: int, *, recipe: dict, steps: int, warmup: int, work_dir: str) -> int:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_bitdet.fingerprint.steps import StepFingerprintWriter
    from megatron_bitdet.train.step_fingerprints import StepDigests

    recipe, enforcement = enforce.results[0]
    state, data = build(recipe, enforcement)
    forward_backward = get_forward_backward_func()
    n_params = sum(b.param_data.numel() for m in state.ddp_modules for b in m.buffers + m.expert_parallel_buffers)
    n_modules = sum(1 for m in state.ddp_modules for _ in m.module.named_modules())  # what the state walks visit
    step_ms, fp_ms, digest_ms = [], [], []
    writer, digests = StepFingerprintWriter(work_dir, rank), StepDigests(state.ddp_modules)
    for step in range(1, steps + warmup + 1):
        t0 = time.perf_counter()
        train_step(state, data, forward_backward)
        t1 = time.perf_counter()
        digested, nbytes = fingerprint(digests, writer, step)
        t2 = time.perf_counter()
        if step > warmup:
            step_ms.append((t1 - t0) * 1e3)
            fp_ms.append((t2 - t1) * 1e3)
            digest_ms.append((digested - t1) * 1e3)
    writer.close()
    ratio = statistics.median(f / s for f, s in zip(fp_ms, step_ms))
    print(f"nemotron_h_tiny (parallel.expert=1), 1 rank, {recipe.determinism.threads} threads, "
          f"{n_params:,} params in DDP buffers, {n_modules} modules; {steps} steps after {warmup} warm-up")
    print(f"step (fwd+bwd+optimizer): median {statistics.median(step_ms):.2f} ms")
    print(f"fingerprint: median {statistics.median(fp_ms):.3f} ms = digests launched "
          f"{statistics.median(digest_ms):.3f} ms + read back, line written/flushed; "
          f"{nbytes:,} bytes of DDP buffers digested a step on this rank")
    print(f"overhead: median per-step ratio {ratio * 100:.3f}% of a step (target <= 0.3%)")
    return 0


bench_worker.before_process_group = enforce


def main() -> int:
    from megatron_bitdet.recipe import load_recipe
    from megatron_bitdet.train.launch import launch
    from megatron_bitdet.train.run import child_env

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args()
    recipe = load_recipe(str(REPO / "recipes" / "nemotron_h_tiny.yaml"),
                         ["parallel.expert=1", f"training.iterations={args.steps + args.warmup}", *args.overrides])
    env = {**child_env(recipe), "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                             os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as work_dir:
        return launch("bench_fingerprint_overhead:bench_worker", 1,
                      {"recipe": recipe.to_dict(), "steps": args.steps, "warmup": args.warmup, "work_dir": work_dir},
                      env=env)


if __name__ == "__main__":
    raise SystemExit(main())
