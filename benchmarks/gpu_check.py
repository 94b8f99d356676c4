"""GPU check: one table of what only an accelerator can show, in one run (<= 8 minutes on one H200).

    python benchmarks/gpu_check.py             # on the GPU machine (megatron-core must be installed)
    python benchmarks/gpu_check.py --dry-run   # anywhere: CPU, tiny shapes, 2 repeats, 2-round launches

Rows: the nondeterministic baselines run N times (atomic Triton grouped-dprob kernel; Transformer
Engine's fused aux loss and grouped GEMM, mamba_ssm's scan/norm/conv backward where importable) with
the number of distinct results; each swapped kernel run N times (>= 20) with its distinct results (1 =
bitwise repeatable) and its time ratio to its baseline; the per-step tax of the default recipe (EP1, one
rank) and the op-tracing overhead. A row whose package is absent says "not importable: ...". Exit 1
when a swapped kernel is not bitwise repeatable.

Only the repository and the machine are needed. On a machine without megatron-core, carry its wheel
(``pip download --no-deps --only-binary=:all: --python-version 3.12 megatron-core==0.16.1``) and put
it on PYTHONPATH before running; rows that need it say so otherwise.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Env:
    def __init__(self, dry: bool, repeats: int):
        self.dry = dry
        self.dev = "cpu" if dry or not torch.cuda.is_available() else "cuda"
        self.repeats = repeats

    def sync(self):
        if self.dev == "cuda":
            torch.cuda.synchronize()

    def size(self, gpu, cpu):
        return cpu if self.dev == "cpu" else gpu


def bits(tensors) -> str:
    h = xxhash.xxh3_64()
    for t in tensors:
        if t is not None:
            h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def repeat(env: Env, fn):
    """(distinct results, median ms) of ``env.repeats`` runs of ``fn`` (returns the tensors to compare)."""
    fn()
    env.sync()
    seen, times = set(), []
    for _ in range(env.repeats):
        t0 = time.perf_counter()
        out = fn()
        env.sync()
        times.append((time.perf_counter() - t0) * 1000)
        seen.add(bits(out))
    return len(seen), statistics.median(times)


def _leaves(*shapes, env, gen, dtype=torch.float32):
    return [torch.randn(*s, generator=gen, dtype=torch.float32).to(env.dev, dtype).requires_grad_() for s in shapes]


def _grads(fn, leaves):
    def run():
        for t in leaves:
            t.grad = None
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
        return [out] + [t.grad for t in leaves]
    return run


# ---- cases: each returns {name: fn} for baseline and swap, or raises ImportError ------------------

def grouped_dprob(env: Env, gen):
    from megatron.core.activations import squared_relu

    from megatron_bitdet.kernels.grouped_mlp import GroupedMLPConfig, grouped_prob_mlp

    t, h, f, e = env.size((8192, 1024, 2048, 8), (64, 16, 32, 4))
    counts = torch.full((e,), t // e, dtype=torch.int64)
    x, probs = _leaves((t, h), (t,), env=env, gen=gen)
    w1, w2 = [(w * 0.02).detach().requires_grad_() for w in _leaves((e, f, h), (e, h, f), env=env, gen=gen)]

    def case(backend):
        return _grads(lambda *a: grouped_prob_mlp(*a[:4], counts, squared_relu, GroupedMLPConfig(backend=backend)),
                      [x, probs, w1, w2])
    baseline, swaps = {}, {"torch (private slots)": case("torch")}
    if env.dev == "cuda":  # the atomic-add upstream pattern exists as a Triton kernel only
        baseline["triton atomic-add dprob"] = case("triton_atomic")
        swaps["triton (private slots)"] = case("triton")
    return "grouped-GEMM dprob", baseline, swaps


def aux_loss(env: Env, gen):
    from megatron.core.transformer.moe import moe_utils

    from megatron_bitdet.kernels.moe_aux import switch_load_balancing_loss_func

    t, e = env.size((32768, 128), (512, 8))
    probs = torch.softmax(torch.randn(t, e, generator=gen), -1).to(env.dev)
    counts = torch.randint(0, t, (e,), generator=gen).to(env.dev)

    def case(fn, **kw):
        def run():
            p = probs.detach().requires_grad_()
            loss = fn(p, counts, t, 6, e, 1e-2, **kw)
            loss.backward()
            return [loss, p.grad]
        return run
    baseline = {"megatron unfused": case(moe_utils.switch_load_balancing_loss_func)}
    if env.dev == "cuda":
        baseline = {"TE fused (atomics)": case(moe_utils.switch_load_balancing_loss_func, fused=True), **baseline}
    return "MoE aux loss", baseline, {"fixed-order tree": case(switch_load_balancing_loss_func)}


def ssd_scan(env: Env, gen):
    from megatron_bitdet.kernels.ssd import ssd_chunk_scan_combined

    b, L, nh, hd, g, ds, chunk = env.size((2, 2048, 16, 64, 1, 128, 256), (1, 32, 2, 4, 1, 4, 16))
    x, dt, B, C = _leaves((b, L, nh, hd), (b, L, nh), (b, L, g, ds), (b, L, g, ds), env=env, gen=gen)
    A = (-torch.rand(nh, generator=gen)).to(env.dev).requires_grad_()
    leaves = [x, dt, A, B, C]

    def ours(x, dt, A, B, C):
        return ssd_chunk_scan_combined(x, dt, A, B, C, chunk, dt_softplus=True)
    swaps = {"bitdet torch chunked scan": _grads(ours, leaves)}
    baseline = {}
    if env.dev == "cuda":
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        baseline["mamba_ssm Triton scan"] = _grads(
            lambda x, dt, A, B, C: mamba_chunk_scan_combined(x, dt, A, B, C, chunk, dt_softplus=True), leaves)
    return "Mamba-2 SSD scan", baseline, swaps


def gated_norm(env: Env, gen):
    from megatron_bitdet.kernels.gated_rmsnorm import gated_rms_norm

    t, d = env.size((16384, 4096), (32, 16))
    x, w, z = _leaves((t, d), (d,), (t, d), env=env, gen=gen)
    swaps = {"bitdet gated RMSNorm": _grads(lambda x, w, z: gated_rms_norm(x, w, z=z, group_size=d // 2), [x, w, z])}
    baseline = {}
    if env.dev == "cuda":
        from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn

        baseline["mamba_ssm Triton rmsnorm"] = _grads(
            lambda x, w, z: rmsnorm_fn(x, w, None, z=z, group_size=d // 2), [x, w, z])
    return "gated RMSNorm", baseline, swaps


def conv1d(env: Env, gen):
    from megatron_bitdet.kernels.causal_conv1d import causal_conv1d_fn as ours

    b, d, L, k = env.size((4, 4096, 2048, 4), (1, 8, 16, 4))
    x, w, bias = _leaves((b, d, L), (d, k), (d,), env=env, gen=gen)
    swaps = {"bitdet causal conv1d": _grads(lambda x, w, bias: ours(x, w, bias, activation="silu"), [x, w, bias])}
    baseline = {}
    if env.dev == "cuda":
        from causal_conv1d import causal_conv1d_fn

        baseline["causal_conv1d CUDA"] = _grads(lambda x, w, bias: causal_conv1d_fn(x, w, bias, activation="silu"),
                                                [x, w, bias])
    return "causal conv1d", baseline, swaps


def te_grouped_gemm(env: Env, gen):
    if env.dev != "cuda":
        raise ImportError("Transformer Engine grouped GEMM needs CUDA")
    from transformer_engine.pytorch import GroupedLinear

    e, t, h, f = 8, 8192, 1024, 2048
    layer = GroupedLinear(e, h, f, bias=False, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(t, h, generator=gen).cuda().to(torch.bfloat16).requires_grad_()
    splits = [t // e] * e

    def run():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        out = layer(x, splits)
        out.backward(torch.ones_like(out))
        return [out, x.grad] + [p.grad for p in layer.parameters()]
    return "TE grouped GEMM", {"TE GroupedLinear": run}, {}


CASES = (grouped_dprob, aux_loss, ssd_scan, gated_norm, conv1d, te_grouped_gemm)


def kernel_rows(env: Env) -> tuple[list, bool]:
    rows, ok = [], True
    for case in CASES:
        gen = torch.Generator().manual_seed(0)
        try:
            title, baselines, swaps = case(env, gen)
        except ImportError as exc:
            rows.append((case.__name__, "-", f"not importable: {exc}", "", ""))
            continue
        base_ms = None
        for name, fn in baselines.items():
            try:
                distinct, ms = repeat(env, fn)
            except Exception as exc:  # a broken optional extra is a row, not a crash
                rows.append((title, f"baseline {name}", f"error: {type(exc).__name__}: {exc}"[:120], "", ""))
                continue
            base_ms = ms if base_ms is None else base_ms
            verdict = f"NONDETERMINISTIC ({distinct} distinct)" if distinct > 1 else "repeatable here (1 distinct)"
            rows.append((title, f"baseline {name}", verdict, f"{ms:.3f}", ""))
        for name, fn in swaps.items():
            distinct, ms = repeat(env, fn)
            ok &= distinct == 1
            verdict = "bitwise (1 distinct)" if distinct == 1 else f"NOT BITWISE ({distinct} distinct)"
            rows.append((title, f"swap {name}", verdict, f"{ms:.3f}", f"{ms / base_ms:.2f}x" if base_ms else "n/a"))
    return rows, ok


def training_rows(env: Env) -> list:
    """The default recipe at EP1 on one rank: its tax and its module/op tracing overhead (launches
    training; the dry run launches the same code for 2 rounds, so a break shows on CPU too)."""
    from benchmarks.bench_trace_training import measure, paired_ratio
    from megatron_bitdet.recipe import load_recipe
    from megatron_bitdet.workflows.tax import measure_tax

    recipe = load_recipe(ROOT / "recipes" / "nemotron_h_tiny.yaml", ["parallel.expert=1"])
    tax_rounds, trace_rounds, warmup = (2, 2, 1) if env.dry else (12, 10, 3)
    rows = []
    tax = measure_tax(recipe, nproc=1, rounds=tax_rounds, warmup=warmup)
    rows.append(("default recipe (EP1)", "tax", f"{tax.paired_tax_percent:+.1f}% paired ({tax.baseline.name})",
                 f"{tax.deterministic.median_ms:.2f}", f"{tax.deterministic.median_ms / tax.baseline.median_ms:.2f}x"))
    per_round = measure(recipe, nproc=1, rounds=trace_rounds, warmup=warmup).wall
    base = statistics.median(per_round["untraced"])
    for level in ("module", "op"):
        rows.append(("default recipe (EP1)", f"{level} tracing", f"paired median of {trace_rounds} rounds",
                     f"{statistics.median(per_round[level]):.2f}", f"{paired_ratio(per_round, level):.2f}x"))
    rows.append(("default recipe (EP1)", "untraced step", "", f"{base:.2f}", "1.00x"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, 2 repeats, 2-round training launches")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if args.dry_run:  # as bitdet's ranks on CPU: megatron's jit_fuser functions eagerly (no Inductor C++ build)
        from megatron_bitdet.compat.cpu_backend import eager_jit_fuser

        eager_jit_fuser()
    env = Env(args.dry_run, 2 if args.dry_run else max(args.repeats, 20))
    if env.dev == "cpu" and not args.dry_run:
        print("no CUDA device: use --dry-run on CPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if env.dev == "cuda" else "cpu (dry run)"
    print(f"gpu_check on {name}, torch {torch.__version__}, {env.repeats} repeats per kernel")
    rows, ok = kernel_rows(env)
    try:
        rows += training_rows(env)
    except ImportError as exc:
        rows.append(("default recipe (EP1)", "tax / tracing", f"not importable: {exc}", "", ""))
    head = ("check", "variant", "result", "ms", "vs baseline")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(5)]
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
