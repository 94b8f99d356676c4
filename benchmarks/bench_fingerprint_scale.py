"""What per-step fingerprints cost as the run grows: digest throughput against memcpy, and bytes and
time digested per rank per step at data-parallel 1 / 2 / 4 (the figures docs/SCALE.md projects from).

1. Throughput on this CPU, 1 MiB to 4 GiB (capped by ``--max-bytes`` and by a third of the memory
   available), best of ``--repeats``: memcpy (``copy_`` into a preallocated tensor); the per-step
   device digest's row pass (``fingerprint.shards.row_sums`` over 4 KiB rows: pos64r, what runs on a
   GPU tensor; its second level reads 1/512 of that), as eager torch ops and compiled into one kernel
   (``torch.compile``: C++ here, Triton on CUDA, where it is the default); the snapshot digests' pos64 (``fingerprint.
   tensor.row_digests`` over 1 MiB chunks); the CPU host fast path (xxh3_64) and format v1's
   xxh3_128 of the host bytes; ``torch.hash_tensor``.
2. Per rank per step, DP 1 / 2 / 4 on gloo (``parallel.expert=1``: every rank is a data-parallel
   replica), the default recipe and the large shape (``benchmarks/shapes.py``): the bytes the step's
   fingerprint digests on each rank, as its slice records report them (``StepDigests.resolve``; the
   largest rank's), and the time of that work (grads and state launched, then resolved), median over
   ``--steps`` steps; ``--device-path`` runs the ranks on the device path (``BITDET_DIGESTS=device``).

    .venv/bin/python benchmarks/bench_fingerprint_scale.py [--max-bytes 4GiB] [--repeats 3] [--steps 5]
        [--dp 1,2,4] [--shapes default,large] [--skip-throughput] [--skip-dp] [--device-path] [--project]

``--project`` prints docs/SCALE.md's cost-model tables (no measurement: every constant is named below).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_fingerprint_overhead import build, enforce  # noqa: E402  (the benchmarks on the path first)

MiB = 1 << 20
GiB = 1 << 30


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '1048576' -> bytes."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    return int(text)


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 * GiB


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def throughput(max_bytes: int, repeats: int) -> list[dict]:
    """GB/s of memcpy and each digest, per size (powers of 4 from 1 MiB)."""
    import torch

    import xxhash

    from megatron_bitdet.fingerprint import shards
    from megatron_bitdet.fingerprint.tensor import exact_digest, row_digests
    from megatron_bitdet.train.snapshot import CHUNK_BYTES

    rows, size = [], MiB
    while size <= max_bytes:
        src = torch.randint(-2**31, 2**31 - 1, (size // 4,), dtype=torch.int32).view(torch.float32)
        dst = torch.empty_like(src)
        ops = {"memcpy": lambda: dst.copy_(src),
               "pos64r row pass, eager": lambda: shards.row_sums(src.view(torch.int64).view(-1, shards.ROW_WORDS), False),
               "pos64r row pass, fused": lambda: shards.row_sums(src.view(torch.int64).view(-1, shards.ROW_WORDS), True),
               "pos64 chunks (snapshot)": lambda: row_digests(src.view(torch.uint8).view(-1, CHUNK_BYTES)),
               "xxh3_64 (CPU fast path)": lambda: xxhash.xxh3_64_hexdigest(memoryview(src.numpy())),
               "xxh3_128 (format v1)": lambda: exact_digest(src)}
        if hasattr(torch, "hash_tensor"):
            ops["torch.hash_tensor"] = lambda: torch.hash_tensor(src.view(torch.int32))
        reps = repeats if size <= 256 * MiB else max(1, repeats - 1)
        for fn in ops.values():
            fn()  # warm: first-touch page faults of dst, cached keys
        rows.append({"bytes": size, **{name: size / _best(fn, reps) / 1e9 for name, fn in ops.items()}})
        del src, dst
        size *= 4
    return rows


def scale_worker(rank: int, world_size: int, *, recipe: dict, steps: int, out: str) -> int:
    """One DP replica: train a step, then time the loop's fingerprint work (``StepDigests``: grads and
    state launched, then resolved) apart from the step; the bytes are what its slice records report."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_bitdet.train.loop import train_step
    from megatron_bitdet.train.step_fingerprints import StepDigests

    recipe, enforcement = enforce.results[0]
    state, data = build(recipe, enforcement)
    forward_backward = get_forward_backward_func()
    digests = StepDigests(state.ddp_modules, optimizer=state.optimizer)  # as the loop: moments when replicated
    step_ms, fp_ms, nbytes = [], [], []
    for step in range(1, steps + 2):  # the first step warms up
        t0 = time.perf_counter()
        train_step(state, data, forward_backward, step=step)
        t1 = time.perf_counter()
        digests.grads(step)
        digests.state(step)
        _, records = digests.resolve()
        t2 = time.perf_counter()
        step_ms.append((t1 - t0) * 1e3)
        fp_ms.append((t2 - t1) * 1e3)
        nbytes.append(sum(hi - lo for rec in records for lo, hi, _ in rec["parts"]))
    params = sum(p.numel() for m in state.ddp_modules for p in m.module.parameters())
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, {"bytes": max(nbytes[1:]), "fp_ms": statistics.median(fp_ms[1:]),
                                                   "step_ms": statistics.median(step_ms[1:]), "params": params})
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": gathered, "dp": ps.get_data_parallel_world_size()}))
    torch.distributed.barrier()
    ps.destroy_model_parallel()
    return 0


scale_worker.before_process_group = enforce


def per_rank(shape: str, dp: int, steps: int, device_path: bool) -> dict:
    from benchmarks.shapes import SHAPES
    from megatron_bitdet.recipe import load_recipe
    from megatron_bitdet.train.launch import launch
    from megatron_bitdet.train.run import child_env

    recipe = load_recipe(ROOT / "recipes" / "nemotron_h_tiny.yaml",
                         [*SHAPES[shape], "parallel.expert=1", f"training.iterations={steps + 2}"])
    env = {**child_env(recipe), "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)]),
           **({"BITDET_DIGESTS": "device"} if device_path else {})}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "scale.json"
        rc = launch("bench_fingerprint_scale:scale_worker", dp, {"recipe": recipe.to_dict(), "steps": steps,
                                                                 "out": str(out)}, run_dir=Path(tmp) / "run", env=env)
        if rc != 0:
            raise SystemExit(f"DP {dp} launch failed (exit {rc})")
        return json.loads(out.read_text())


# ----------------------------------------------------------------------------- projection (docs/SCALE.md)
H100_HBM = 3.35e12        # B/s, H100 SXM HBM3 (NVIDIA's datasheet)
D2H = 25e9                # B/s, a device-to-host copy over PCIe Gen5 x16 in practice (the figure)
HOST_XXH3 = 20e9          # B/s, xxh3 on one fast host core (the figure; this CPU: the throughput table)
H100_BF16 = 989e12        # FLOP/s, dense BF16 (datasheet)
MFU = 0.40
TOKENS = 768 * 8192       # global batch: 768 sequences x 8192 tokens (the assumption)
CHECK_K = 4               # fingerprint.shards.CHECK_CHUNKS: the replica check adds 1/K of a replicated slice
PASSES = 1                # bytes moved per byte by the fused row pass (shards.fused_row_pass: each word read once)
EAGER_PASSES = 8          # its eager fallback (add 16, shift 16, xor 24, sum 8 per 8 bytes)
BLOCK = 256 * MiB         # the eager fallback's row block on a GPU (shards._DEVICE_BLOCK_WORDS x 8): 4 kernels a block
KERNEL_S = 2e-6           # GPU time floor of one small queued kernel
LEVEL2_KERNELS = 8        # per device and step: cat, keys, add, shift, xor, per-job sums (shards.Pending.launch)
LEAF_BYTES = 150          # a digest file's bytes per tensor leaf besides its chunk digests (names, dtype, shape)
LEAVES = 4 * 6 * 52       # tensor leaves per rank: ~6 tensors a layer x 52 layers, each as param, main, 2 moments
TENSORS = 6 * 52          # parameter tensors of a DDP buffer family (main params and moments: one tensor each)

# name: (total params, active params, routed-expert params, {GPUs: (TP, PP, EP)}). Layout: the smallest
# TP with data-parallel size <= 768 (one sequence per replica at least); 56B at TP 8 (its state per GPU).
MODELS = {
    "Nemotron-H 8B": (8.0e9, 8.0e9, 0.0, {8: (1, 1, 1), 64: (1, 1, 1), 1024: (2, 1, 1), 6144: (8, 1, 1)}),
    "Nemotron-H 56B": (56e9, 56e9, 0.0, {8: (8, 1, 1), 64: (8, 1, 1), 1024: (8, 1, 1), 6144: (8, 1, 1)}),
    "Nemotron 3 Nano": (31.6e9, 3.5e9, 23 * 128 * 2 * 2688 * 1856,
                        {8: (1, 1, 8), 64: (1, 1, 8), 1024: (2, 1, 8), 6144: (8, 1, 8)}),
}


def sharded_regions(params: float, replicas: int) -> list[float]:
    """Bytes per rank of one DDP buffer family's digest jobs under format v2 (``--bf16
    --use-distributed-optimizer``): the bf16 params' slice (plus the replica check's 1/K), the owned
    fp32 grad shard, the owned fp32 main-param shard (fingerprint/shards.py's formula)."""
    if replicas == 1:
        return [2 * params, 4 * params, 4 * params]
    return [2 * params / replicas, 2 * params / (replicas * CHECK_K), 4 * params / replicas, 4 * params / replicas]


def replicated_regions(params: float, replicas: int) -> tuple[list[float], int]:
    """(bytes per job, fused kernels) per rank of one DDP buffer family without the distributed
    optimizer (``--bf16``): bf16 params, fp32 grads, fp32 main params and Adam's two fp32 moments, all
    replicated, each a slice plus the step's check chunk (1/K of a slice). The buffers are contiguous
    (a kernel a job); main params and moments are one tensor a parameter (a kernel per tensor the
    slice touches: ``TENSORS`` / DP + 1, and 2 for the check chunk)."""
    sizes = [2, 4, 4, 4, 4]
    if replicas == 1:
        return [b * params for b in sizes], 2 + 3 * TENSORS
    jobs = [b * params / replicas * f for b in sizes for f in (1, 1 / CHECK_K)]
    return jobs, 4 + 3 * (-(-TENSORS // replicas) + 1 + 2)


def projection_rows(distopt: bool = True) -> list[dict]:
    """Per model and GPU count: bytes per rank per step, time and % of the step, today vs sharded
    (``distopt``: Megatron-LM's ``--use-distributed-optimizer``; else every buffer and Adam's moments
    replicated, ``replicated_regions``)."""
    rows = []
    for name, (total, active, experts, layouts) in MODELS.items():
        dense = total - experts
        for n, (tp, pp, ep) in layouts.items():
            dp, edp = n // (tp * pp), n // (ep * pp)
            p_rank = dense / (tp * pp) + experts / (ep * pp)
            step = 6 * active * TOKENS / (n * H100_BF16 * MFU)
            today = 6 * p_rank
            if distopt:
                jobs = sharded_regions(dense / (tp * pp), dp)
                if experts:
                    jobs += sharded_regions(experts / (ep * pp), edp)
                kernels = len(jobs) + LEVEL2_KERNELS  # fused: one kernel a job's matrix (a DDP buffer's bytes)
            else:
                jobs, kernels = replicated_regions(dense / (tp * pp), dp)
                if experts:
                    more, k = replicated_regions(experts / (ep * pp), edp)
                    jobs, kernels = jobs + more, kernels + k
                kernels += LEVEL2_KERNELS
            new = sum(jobs)
            eager_kernels = sum(4 * -(-b // BLOCK) for b in jobs) + LEVEL2_KERNELS
            t_today = today / D2H + today / HOST_XXH3
            t_ideal = new / H100_HBM
            t_coded = new * PASSES / H100_HBM + kernels * KERNEL_S
            t_eager = new * EAGER_PASSES / H100_HBM + eager_kernels * KERNEL_S
            snapshot_old = 2 * p_rank + 12 * p_rank / dp  # bf16 params + fp32 main, exp_avg, exp_avg_sq (distopt)
            rows.append({"model": name, "gpus": n, "tp": tp, "pp": pp, "ep": ep, "dp": dp, "edp": edp, "experts": experts, "step_s": step,
                         "today_bytes": today, "today_s": t_today, "new_bytes": new, "ideal_s": t_ideal,
                         "coded_s": t_coded, "kernels": kernels, "eager_s": t_eager,
                         "eager_kernels": eager_kernels, "snapshot_old": snapshot_old,
                         # 16 hex digits + 3 JSON bytes per MiB chunk, plus each leaf's own fields
                         "snapshot_new": snapshot_old / MiB * 19 + LEAVES * LEAF_BYTES})
    return rows


def _b(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


def _t(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} µs"


def print_projection() -> None:
    """The cost model's tables as markdown (docs/SCALE.md holds their output)."""
    print("| model | GPUs | TP/PP/EP, DP | step | today: bytes/rank | today: time | today: % | "
          "sharded: bytes/rank | sharded: time at HBM | sharded: % | as coded (fused): time | as coded: % | "
          "eager fallback: time | eager: % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in projection_rows():
        pct = lambda t: f"{t / r['step_s'] * 100:.3g}%"  # noqa: E731
        print(f"| {r['model']} | {r['gpus']:,} | {r['tp']}/{r['pp']}/{r['ep']}, {r['dp']} | {_t(r['step_s'])} | "
              f"{_b(r['today_bytes'])} | {_t(r['today_s'])} | {pct(r['today_s'])} | {_b(r['new_bytes'])} | "
              f"{_t(r['ideal_s'])} | {pct(r['ideal_s'])} | {_t(r['coded_s'])} ({r['kernels']:.0f} kernels) | "
              f"{pct(r['coded_s'])} | {_t(r['eager_s'])} ({r['eager_kernels']:.0f} kernels) | {pct(r['eager_s'])} |")
    print("\nWithout the distributed optimizer (every buffer and Adam's moments replicated and replica-checked):\n")
    print("| model | GPUs | TP/PP/EP, DP | step | bytes/rank | time at HBM | % | as coded (fused): time | as coded: % | "
          "replica check: every copy within (steps) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in projection_rows(distopt=False):
        pct = lambda t: f"{t / r['step_s'] * 100:.3g}%"  # noqa: E731
        groups = (r["dp"], r["edp"]) if r["experts"] else (r["dp"],)  # dense, then expert buffers
        bound = ", ".join(f"{d * CHECK_K:,}" for d in groups if d > 1) or "-"
        print(f"| {r['model']} | {r['gpus']:,} | {r['tp']}/{r['pp']}/{r['ep']}, {r['dp']} | {_t(r['step_s'])} | "
              f"{_b(r['new_bytes'])} | {_t(r['ideal_s'])} | {pct(r['ideal_s'])} | {_t(r['coded_s'])} "
              f"({r['kernels']:.0f} kernels) | {pct(r['coded_s'])} | {bound} |")
    print("\n| model | GPUs | full-state snapshot per rank | all ranks | digest snapshot per rank | all ranks |")
    print("|---|---|---|---|---|---|")
    for r in projection_rows():
        print(f"| {r['model']} | {r['gpus']:,} | {_b(r['snapshot_old'])} | {_b(r['snapshot_old'] * r['gpus'])} | "
              f"{_b(r['snapshot_new'])} | {_b(r['snapshot_new'] * r['gpus'])} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-bytes", type=parse_bytes, default=4 * GiB)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dp", default="1,2,4")
    ap.add_argument("--shapes", default="default,large")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-dp", action="store_true")
    ap.add_argument("--device-path", action="store_true",
                    help="DP rows on the device digest path (BITDET_DIGESTS=device; default: the CPU host fast path)")
    ap.add_argument("--project", action="store_true", help="print docs/SCALE.md's projection tables and stop")
    args = ap.parse_args()
    if args.project:
        print_projection()
        return 0
    if not args.skip_throughput:
        cap = min(args.max_bytes, _available_bytes() // 3)
        rows = throughput(cap, args.repeats)
        names = [k for k in rows[0] if k != "bytes"]
        print(f"digest throughput on this CPU, GB/s (best of {args.repeats}; sizes to {cap / GiB:.2f} GiB, capped by "
              f"--max-bytes and a third of the available memory); in brackets: x memcpy")
        print(f"  {'size':>9} " + " ".join(f"{n:>28}" for n in names))
        for r in rows:
            size = f"{r['bytes'] / MiB:.0f} MiB" if r["bytes"] < GiB else f"{r['bytes'] / GiB:.0f} GiB"
            print(f"  {size:>9} " + " ".join(f"{r[n]:>21.2f} ({r[n] / r['memcpy']:4.2f}x)" for n in names))
    if not args.skip_dp:
        path = "device path (pos64r on CPU tensors)" if args.device_path else "CPU host fast path (xxh3_64)"
        print(f"\nper rank per step, the loop's fingerprint work, {path} (median of {args.steps} steps; gloo, "
              f"2 cores shared; bytes: the DDP regions' slice records, the largest rank's; small state apart):")
        print(f"  {'shape':<8} {'DP':>3} {'params':>10} {'bytes/rank':>12} {'x DP 1':>7} {'digest ms':>10} "
              f"{'step ms':>9} {'% of step':>10}")
        first = {}
        for shape in args.shapes.split(","):
            for dp in map(int, args.dp.split(",")):
                data = per_rank(shape, dp, args.steps, args.device_path)
                r0 = data["ranks"][0]
                nbytes = max(r["bytes"] for r in data["ranks"])
                fp = statistics.median(r["fp_ms"] for r in data["ranks"])
                step = statistics.median(r["step_ms"] for r in data["ranks"])
                base = first.setdefault(shape, nbytes)
                print(f"  {shape:<8} {data['dp']:>3} {r0['params']:>10,} {nbytes:>12,} {nbytes / base:>7.3f} "
                      f"{fp:>10.3f} {step:>9.1f} {fp / step * 100:>9.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
