"""Cost of per-step fingerprinting as a fraction of a training step (target: <= 0.3%).

At each data-parallel size asked for (``--dp``, default 1,2,4): that many rank processes (started by
bitdet's launcher with the run's determinism environment), a gloo world, the tiny hybrid recipe with
``parallel.expert=1`` (every parameter data-parallel: at DP >= 2 each replicated buffer is sharded
over the ranks, plus one replica-check chunk a step; the distributed optimizer's grad shard is each
rank's own), set up exactly as ``bitdet train`` does. Each round runs one training step (forward +
backward over all micro-batches, optimizer, scheduler) and then the fingerprint work the loop does for
it (``StepDigests``: the grads' digests, then the state's: params, the optimizer's state where it is
replicated (no distributed optimizer), the model's buffers, the generators it holds, the precision
digests; then the digests read back and one JSON line written and flushed; the writer fsyncs once, at
close), timing both: interleaved by construction, medians over the rounds, per rank; the row is the
rank with the highest ratio.

Which digest path (``--digests``): ``device`` (default) forces the ``pos64r`` path a GPU runs
(``BITDET_DIGESTS=device``: the same torch integer ops, on the CPU tensors; the row pass as eager ops
unless ``BITDET_DIGESTS_FUSED=1``), ``host`` the CPU tensors' own ``xxh3_64`` path. Each row names
the path it measured (from the digests the line holds) and the layout.

    .venv/bin/python benchmarks/bench_fingerprint_overhead.py [--steps 30] [--warmup 3] [--dp 1,2,4]
        [--digests device|host] [KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import json
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


def fingerprint(digests, writer, step: int) -> tuple[float, dict]:
    """What the loop adds per step: the grads' digests (in training launched before the optimizer), the
    state's (``StepDigests.state``), then one line: the digests read back, the line written and
    flushed. Returns the time at which the digests were launched (the line reported apart) and the
    line."""
    digests.grads(step)
    digests.state(step)
    launched = time.perf_counter()
    return launched, writer.write(step, {"loss": 1.0, "lr": 0.001}, *digests.resolve())


def bench_worker(rank: int, world_size: int, *, recipe: dict, steps: int, warmup: int, work_dir: str,
                 out: str) -> int:
    """Times this rank's steps and fingerprints; rank 0 writes every rank's medians to ``out`` (JSON)."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_bitdet.fingerprint.shards import fused_row_pass
    from megatron_bitdet.fingerprint.steps import StepFingerprintWriter
    from megatron_bitdet.train.step_fingerprints import StepDigests

    recipe, enforcement = enforce.results[0]
    state, data = build(recipe, enforcement)
    forward_backward = get_forward_backward_func()
    n_params = sum(b.param_data.numel() for m in state.ddp_modules for b in m.buffers + m.expert_parallel_buffers)
    n_modules = sum(1 for m in state.ddp_modules for _ in m.module.named_modules())  # what the state walks visit
    step_ms, fp_ms, digest_ms = [], [], []
    writer, digests = StepFingerprintWriter(work_dir, rank), StepDigests(state.ddp_modules, optimizer=state.optimizer)
    for step in range(1, steps + warmup + 1):
        t0 = time.perf_counter()
        train_step(state, data, forward_backward)
        t1 = time.perf_counter()
        digested, line = fingerprint(digests, writer, step)
        t2 = time.perf_counter()
        if step > warmup:
            step_ms.append((t1 - t0) * 1e3)
            fp_ms.append((t2 - t1) * 1e3)
            digest_ms.append((digested - t1) * 1e3)
    writer.close()
    own = sum(hi - lo for rec in line["slices"] if "check_of" not in rec for lo, hi, _ in rec["parts"])
    checked = sum(hi - lo for rec in line["slices"] if "check_of" in rec for lo, hi, _ in rec["parts"])
    mine = {"rank": rank, "step_ms": statistics.median(step_ms), "fp_ms": statistics.median(fp_ms),
            "digest_ms": statistics.median(digest_ms), "ratio": statistics.median(f / s for f, s in zip(fp_ms, step_ms)),
            "own_bytes": own, "check_bytes": checked,
            "algos": sorted({d.partition(":")[0] for d in line["digests"].values()})}
    ranks = [None] * world_size
    torch.distributed.all_gather_object(ranks, mine)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "dp": world_size, "threads": recipe.determinism.threads, "params": n_params, "modules": n_modules,
            "steps": steps, "warmup": warmup, "distributed_optimizer": recipe.parallel.distributed_optimizer,
            "params_dtype": recipe.model.params_dtype, "fused": fused_row_pass("cpu") is not None, "ranks": ranks}))
    return 0


bench_worker.before_process_group = enforce


def row(result: dict) -> str:
    """One table row: the rank whose fingerprint costs the largest share of its step, and the path
    and layout measured."""
    worst = max(result["ranks"], key=lambda r: r["ratio"])
    algos = sorted({a for r in result["ranks"] for a in r["algos"]})
    path = {"pos64r": "device path (pos64r, forced on CPU, " + ("fused" if result["fused"] else "eager") + " row pass)",
            "xxh3_64": "host path (xxh3_64)"}
    layout = (f"DP {result['dp']}, EP 1, {result['params_dtype']} params, distributed optimizer "
              f"{'on' if result['distributed_optimizer'] else 'off'}, {result['threads']} threads a rank")
    return (f"| {' + '.join(path.get(a, a) for a in algos)} | {layout} | {worst['step_ms']:.2f} ms | "
            f"{worst['fp_ms']:.3f} ms (launch {worst['digest_ms']:.3f} ms) | **{worst['ratio'] * 100:.3f}%** | "
            f"{worst['own_bytes']:,} + {worst['check_bytes']:,} |")


def main() -> int:
    from megatron_bitdet.errors import BitdetInputError
    from megatron_bitdet.recipe import load_recipe
    from megatron_bitdet.train.launch import launch
    from megatron_bitdet.train.run import check_layout, child_env

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dp", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 4],
                    help="data-parallel sizes, comma-separated (one launch each; default 1,2,4)")
    ap.add_argument("--digests", choices=("device", "host"), default="device",
                    help="device: the GPU's pos64r path forced on the CPU tensors; host: their xxh3_64 path")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0")
    recipe = load_recipe(str(REPO / "recipes" / "nemotron_h_tiny.yaml"),
                         ["parallel.expert=1", f"training.iterations={args.steps + args.warmup}", *args.overrides])
    try:
        for dp in args.dp:
            check_layout(recipe, dp)
    except BitdetInputError as exc:
        ap.error(str(exc))
    env = {**child_env(recipe), "BITDET_DIGESTS": args.digests,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    rows = []
    with tempfile.TemporaryDirectory() as work_dir:
        for dp in args.dp:
            out = Path(work_dir) / f"dp{dp}.json"
            rc = launch("bench_fingerprint_overhead:bench_worker", dp,
                        {"recipe": recipe.to_dict(), "steps": args.steps, "warmup": args.warmup,
                         "work_dir": str(Path(work_dir) / f"dp{dp}"), "out": str(out)}, env=env)
            if rc:
                return rc
            result = json.loads(out.read_text())
            rows.append(row(result))
            print(f"DP {dp}: nemotron_h_tiny (parallel.expert=1), {result['params']:,} params in DDP buffers, "
                  f"{result['modules']} modules; {args.steps} steps after {args.warmup} warm-up; per rank "
                  "(step, fingerprint, ratio): " + "; ".join(
                      f"{r['rank']}: {r['step_ms']:.1f} ms, {r['fp_ms']:.3f} ms, {r['ratio'] * 100:.3f}%"
                      for r in result["ranks"]))
    print("\n| digest path | layout | step (fwd+bwd+optimizer), median | fingerprint, median "
          "| per-step ratio, median (target <= 0.3%) | bytes digested a step, own + replica check |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
