"""GPU check: one table of what only an accelerator can show, in one run (<= 8 minutes on one GPU).

    python benchmarks/gpu_check.py             # on the GPU machine (megatron-core must be installed)
    python benchmarks/gpu_check.py --dry-run   # anywhere: CPU, tiny shapes, 2 repeats, 2-round launches

Every row is independent: a row that raises prints FAILED with its error and the others still run; a
row whose package is absent says "not importable: ..."; once the 8-minute budget is spent the rows left
say "skipped". Each finished row is also printed to stderr as it comes, so a killed run keeps what it
measured; the aligned table goes to stdout at the end, whatever happened. Exit 1 when a row failed or a
swapped kernel is not bitwise repeatable.

Rows:
- swap kernels: each nondeterministic upstream kernel they replace run N times (atomic Triton grouped
  dprob, TE's fused aux loss and grouped GEMM, mamba_ssm's scan / norm / conv backward where importable)
  with the number of distinct results; each swapped kernel run N times (>= 20) with its distinct
  results (1 = bitwise repeatable) and its time against that baseline;
- the grouped experts' F.grouped_mm in fp32 and bf16 (see below);
- FusedAdam resume: TE's (else apex's) FusedAdam saved and restored through compat.checkpoint continues
  bitwise, and diverges without the group-step rule (megatron_bitdet.testing.optimizer);
- device digest: the per-step state digest computed on the device, against a device memcpy of the same
  bytes (fingerprint.shards' device path where present, else fingerprint.tensor's pos64);
- TE-spec model twins and TE FP8 twins: two independent ``bitdet train`` runs with ``model.spec=te``
  (the FP8 recipe for the second), compared bit for bit;
- the default recipe (EP1, one rank): its determinism tax and its module / op tracing overhead;
- bitdet vs upstream: bitdet's recipe against upstream's deterministic mode at the large shape (EP1,
  one rank, 60 paired rounds, the interval and bench_tax_vs_upstream's verdict).

grouped_mm dtype (decided): the default recipe is fp32 and its grouped experts keep fp32 on CUDA. torch
(>= 2.9, pytorch#162059) serves fp32 ``F.grouped_mm`` on CUDA with its per-group fallback: one cuBLAS
GEMM per expert after copying the offsets to the host, as deterministic as cuBLAS under
CUBLAS_WORKSPACE_CONFIG and slower than the grouped CUTLASS kernel that only bf16 gets. Casting to bf16
inside the experts would change the numbers the recipe asked for and break the bitwise agreement with
the sequential experts; bf16 recipes take the fast kernel. The grouped_mm rows time both against the
per-expert loop they replace.

``--plant-failure CHECK`` makes that check's row raise (CI's proof that one failing row leaves the
table whole). Only the repository and the machine are needed: on a bare GPU machine with Python 3.12 and
torch (no package index), ``make gpu-kit`` here first (megatron-core 0.19.2, the plugin and its other
dependencies as cp312 wheels in ``gpu-kit/``, <= 64 MiB, checked to resolve offline), carry the tree with
``gpu-kit/``, and there, from the repository root, install them and run the table on 0.19.2 in one command:

    python3 -m pip install -q --no-index --find-links gpu-kit megatron-core==0.19.2 megatron-bitdet && python3 benchmarks/gpu_check.py

The table's first line names the megatron-core it ran on; rows that need an absent package say so.
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


# ---- kernel cases: each returns ({name: fn} of baselines, {name: fn} of swaps), or raises ImportError -----

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
    return baseline, swaps


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
    return baseline, {"fixed-order tree": case(switch_load_balancing_loss_func)}


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
    return baseline, swaps


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
    return baseline, swaps


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
    return baseline, swaps


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
    return {"TE GroupedLinear": run}, {}


def grouped_mm(dtype):
    """The grouped experts' segment GEMM in ``dtype`` against the per-expert loop of GEMMs it replaces
    (fp32, the default recipe: torch's per-group fallback on CUDA; bf16: the grouped kernel)."""
    def case(env: Env, gen):
        import torch.nn.functional as F

        t, h, f, e = env.size((8192, 1024, 2048, 8), (64, 16, 32, 4))
        offs = torch.arange(1, e + 1, dtype=torch.int32, device=env.dev) * (t // e)
        x = torch.randn(t, h, generator=gen).to(env.dev, dtype)
        w = (torch.randn(e, f, h, generator=gen) * 0.02).to(env.dev, dtype).transpose(1, 2)
        loop = lambda: [torch.cat([x[i * (t // e):(i + 1) * (t // e)] @ w[i] for i in range(e)])]  # noqa: E731
        return {"per-expert loop": loop}, {"F.grouped_mm": lambda: [F.grouped_mm(x, w, offs=offs)]}
    return case


CASES = {"grouped-GEMM dprob": grouped_dprob, "MoE aux loss": aux_loss, "Mamba-2 SSD scan": ssd_scan,
         "gated RMSNorm": gated_norm, "causal conv1d": conv1d, "TE grouped GEMM": te_grouped_gemm,
         "grouped_mm fp32": grouped_mm(torch.float32), "grouped_mm bf16": grouped_mm(torch.bfloat16)}
BUDGET_S = 480


class Row(tuple):
    """(check, variant, result, ms, vs baseline) plus whether it failed."""

    failed = False

    def __new__(cls, check, variant, result, ms="", ratio="", *, failed=False):
        row = super().__new__(cls, (check, variant, result, ms, ratio))
        row.failed = failed
        return row


class Table:
    """Runs every row on its own: an error becomes that row's FAILED line; the budget is shared."""

    def __init__(self, plant: str | None, budget_s: float = BUDGET_S):
        self.plant, self.rows = plant, []
        self.deadline = time.monotonic() + budget_s

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, row: Row) -> None:
        """Streamed on a line of its own: a launch's ranks share this stderr, and what they leave unterminated
        (Triton's nanobind leak report at exit, where megatron-core 0.18+ imported Triton) would head the line."""
        self.rows.append(row)
        print("\nrow: " + " | ".join(str(c) for c in row), file=sys.stderr, flush=True)

    def check(self, name: str, rows_of) -> None:
        """``rows_of()`` yields the check's rows; whatever it raises is this check's last row."""
        if self.left_s() <= 0:
            self.add(Row(name, "-", f"skipped: the {BUDGET_S // 60}-minute budget is spent"))
            return
        try:
            if name == self.plant:
                raise RuntimeError("planted failure (--plant-failure)")
            for row in rows_of():
                self.add(row)
        except ImportError as exc:
            self.add(Row(name, "-", f"not importable: {exc}"))
        except (Exception, SystemExit) as exc:  # a launch helper may exit: still one row
            self.add(Row(name, "-", f"FAILED: {type(exc).__name__}: {exc}"[:160], failed=True))

    def print(self) -> None:
        head = ("check", "variant", "result", "ms", "vs baseline")
        widths = [max(len(str(r[i])) for r in [head, *self.rows]) for i in range(5)]
        for r in [head, tuple("-" * w for w in widths), *self.rows]:
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
        sys.stdout.flush()


def _variant(title, kind, name, fn, env, base_ms):
    """One baseline or swap of a kernel case as a row (its own error as a FAILED row)."""
    try:
        distinct, ms = repeat(env, fn)
    except Exception as exc:  # a broken optional extra is a row, not a crash
        return Row(title, f"{kind} {name}", f"FAILED: {type(exc).__name__}: {exc}"[:160], failed=True), None
    if kind == "baseline":
        verdict = f"NONDETERMINISTIC ({distinct} distinct)" if distinct > 1 else "repeatable here (1 distinct)"
        return Row(title, f"baseline {name}", verdict, f"{ms:.3f}"), ms
    verdict = "bitwise (1 distinct)" if distinct == 1 else f"NOT BITWISE ({distinct} distinct)"
    return Row(title, f"swap {name}", verdict, f"{ms:.3f}", f"{ms / base_ms:.2f}x" if base_ms else "n/a",
               failed=distinct != 1), ms


def kernel_rows(env: Env, title: str, case):
    baselines, swaps = case(env, torch.Generator().manual_seed(0))
    base_ms = None
    for name, fn in baselines.items():
        row, ms = _variant(title, "baseline", name, fn, env, None)
        base_ms = base_ms if base_ms is not None or ms is None else ms
        yield row
    for name, fn in swaps.items():
        yield _variant(title, "swap", name, fn, env, base_ms)[0]


def fused_adam_rows(env: Env):
    """Megatron's optimizer class where TE or apex is installed, restored through compat.checkpoint."""
    from megatron_bitdet.testing.optimizer import load_dropping_group_step, resume_matches

    if env.dev == "cpu":  # dry run: the same path with torch's AdamW (no FusedAdam without CUDA)
        cls, needs_rule = torch.optim.AdamW, False
    else:
        try:
            from transformer_engine.pytorch.optimizers import FusedAdam as cls
        except ImportError:
            from apex.optimizers import FusedAdam as cls
        needs_rule = True
    name = f"{cls.__module__}.{cls.__name__}"
    t0 = time.perf_counter()
    holds = resume_matches(cls, device=env.dev)
    without = resume_matches(cls, device=env.dev, load=load_dropping_group_step) if needs_rule else None
    ms = f"{(time.perf_counter() - t0) * 1000:.1f}"
    verdict = ("bitwise resume" if holds else "RESUME DIVERGES") + (
        "" if without is None else "; without the group-step rule " + ("still bitwise (rule not needed?)"
                                                                       if without else "diverges (rule needed)"))
    yield Row("FusedAdam resume", name, verdict, ms, failed=not holds)


def digest_rows(env: Env):
    """Throughput of the device-resident state digest against a device memcpy of the same bytes."""
    try:
        from megatron_bitdet.fingerprint.shards import state_digest

        name, digest = "fingerprint.shards.state_digest", lambda t: state_digest([t])
    except ImportError:
        from megatron_bitdet.fingerprint.tensor import pos_digest as digest

        name = "fingerprint.tensor.pos_digest"
    n = env.size(1 << 28, 1 << 20)  # float32 elements: 1 GiB on a GPU
    t = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(env.dev)
    out = torch.empty_like(t)
    copied = repeat(env, lambda: [out.copy_(t)])[1]
    digests = set()
    ms = repeat(env, lambda: digests.add(digest(t)) or [])[1]
    gib = t.numel() * t.element_size() / 2**30
    verdict = f"{gib / (ms / 1000):.1f} GiB/s vs memcpy {gib / (copied / 1000):.1f} GiB/s"
    yield Row("device digest", name, verdict + ("" if len(digests) == 1 else f"; NOT REPEATABLE ({len(digests)})"),
              f"{ms:.3f}", f"{ms / copied:.2f}x", failed=len(digests) != 1)


def nvfp4_rows(env: Env):
    """TE's NVFP4BlockScaling (TE >= 2.7, Blackwell) from the recipe's model.fp4 keys, repeated bitwise."""
    if env.dev != "cuda":
        raise ImportError("Transformer Engine NVFP4 needs CUDA (TE >= 2.7, Blackwell)")
    from megatron_bitdet.kernels.fp4_linear import te_nvfp4_twice

    distinct, ms = te_nvfp4_twice(env.repeats)
    yield Row("TE NVFP4 linear", "te.Linear + NVFP4BlockScaling",
              "bitwise" if distinct == 1 else f"NOT REPEATABLE ({distinct} results)", f"{ms:.3f}",
              failed=distinct != 1)


def twins_rows(title: str, recipe: str, overrides: list, left_s):
    """Two independent ``bitdet train`` runs with Transformer Engine's spec, compared bit for bit."""
    import tempfile

    from megatron_bitdet.testing import check_end_to_end

    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # TE raises OSError/RuntimeError too where CUDA is missing
        raise ImportError(f"transformer_engine ({type(exc).__name__}: {exc})"[:120]) from None
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report = check_end_to_end(recipe, ["model.spec=te", "parallel.expert=1", *overrides], workdir=tmp,
                                  nproc=1, steps=3, timeout=max(1.0, left_s()))
    yield Row(title, f"{recipe} model.spec=te", f"bitwise ({report.steps} steps, {report.metrics} metrics + "
              f"{report.digests} digests)", f"{(time.perf_counter() - t0) * 1000:.0f}")


def _tiny_ep1(overrides=()):
    from megatron_bitdet.recipe import load_recipe

    return load_recipe(ROOT / "recipes" / "nemotron_h_tiny.yaml", ["parallel.expert=1", *overrides])


def tax_rows(env: Env):
    """The default recipe at EP1 on one rank: its tax (the dry run launches the same code for 2 rounds,
    so a break shows on CPU too)."""
    from megatron_bitdet.workflows.tax import measure_tax

    rounds, warmup = (2, 1) if env.dry else (12, 3)
    tax = measure_tax(_tiny_ep1(), nproc=1, rounds=rounds, warmup=warmup)
    yield Row("default recipe (EP1)", "tax", f"{tax.paired_tax_percent:+.1f}% paired ({tax.baseline.name})",
              f"{tax.deterministic.median_ms:.2f}", f"{tax.deterministic.median_ms / tax.baseline.median_ms:.2f}x")


def upstream_rows(env: Env):
    """bitdet's recipe vs upstream's deterministic mode (bench_tax_vs_upstream's two sides) at the large
    shape, EP1 on one rank: on a GPU upstream's NaN-fill is a device memset per allocation. The dry run
    launches the same code at the default shape for 2 rounds."""
    import tempfile

    from benchmarks.bench_tax_vs_upstream import GOAL, paired, pct, sides_for
    from benchmarks.intervals import verdict
    from benchmarks.shapes import SHAPES
    from megatron_bitdet.workflows.tax import TaxConfig, run_sides, with_measured_batches

    shape, cfg = ("default", TaxConfig(rounds=2, warmup=1, profile_steps=1)) if env.dry else \
        ("large", TaxConfig(rounds=60, warmup=3, profile_steps=1))
    recipe = with_measured_batches(_tiny_ep1(SHAPES[shape]), cfg)
    with tempfile.TemporaryDirectory() as tmp:
        (bitdet, upstream), _, _ = run_sides(recipe, sides_for(recipe)[:2], nproc=1, config=cfg, out_dir=tmp)
    ratio, interval = paired(bitdet.step_ms, upstream.step_ms)
    yield Row(f"bitdet vs upstream ({shape}, EP1)", f"{cfg.rounds} paired rounds",
              f"{pct(ratio, interval).strip()} ({verdict(ratio, interval, GOAL, cfg.rounds)})",
              f"{bitdet.median_ms:.2f}", f"{ratio:.3f}x")


def tracing_rows(env: Env):
    from benchmarks.bench_trace_training import measure, paired_ratio

    rounds, warmup = (2, 1) if env.dry else (10, 3)
    per_round = measure(_tiny_ep1(), nproc=1, rounds=rounds, warmup=warmup).wall
    for level in ("module", "op"):
        yield Row("default recipe (EP1)", f"{level} tracing", f"paired median of {rounds} rounds",
                  f"{statistics.median(per_round[level]):.2f}", f"{paired_ratio(per_round, level):.2f}x")
    yield Row("default recipe (EP1)", "untraced step", "", f"{statistics.median(per_round['untraced']):.2f}", "1.00x")


def checks(env: Env, table: Table) -> list:
    """(check name, rows) in the order they run: the quick kernel rows first, the launches last."""
    return [*((title, lambda t=title, c=case: kernel_rows(env, t, c)) for title, case in CASES.items()),
            ("FusedAdam resume", lambda: fused_adam_rows(env)),
            ("device digest", lambda: digest_rows(env)),
            ("TE NVFP4 linear", lambda: nvfp4_rows(env)),
            ("TE-spec model twins", lambda: twins_rows("TE-spec model twins", "nemotron_h_tiny", [], table.left_s)),
            ("TE FP8 twins", lambda: twins_rows("TE FP8 twins", "nemotron_h_tiny_fp8",
                                                ["model.moe.expert_impl=sequential"], table.left_s)),
            ("default recipe (EP1) tax", lambda: tax_rows(env)),
            ("bitdet vs upstream", lambda: upstream_rows(env)),
            ("default recipe (EP1) tracing", lambda: tracing_rows(env))]


def _megatron_core() -> str:
    from megatron_bitdet.compat.versions import megatron_core_version
    from megatron_bitdet.errors import BitdetError

    try:
        return megatron_core_version()
    except BitdetError:
        return "not installed"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, 2 repeats, 2-round training launches")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--plant-failure", metavar="CHECK", help="make CHECK's row raise (the table must stay whole)")
    args = ap.parse_args()
    if args.dry_run:  # as bitdet's ranks on CPU: megatron's jit_fuser functions eagerly (no Inductor C++ build)
        from megatron_bitdet.compat.cpu_backend import eager_jit_fuser

        eager_jit_fuser()
    env = Env(args.dry_run, 2 if args.dry_run else max(args.repeats, 20))
    if env.dev == "cpu" and not args.dry_run:
        print("no CUDA device: use --dry-run on CPU", file=sys.stderr)
        return 2
    table = Table(args.plant_failure)
    planned = checks(env, table)
    if args.plant_failure is not None and args.plant_failure not in dict(planned):
        print(f"--plant-failure {args.plant_failure!r}: no such check; checks: {', '.join(dict(planned))}",
              file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if env.dev == "cuda" else "cpu (dry run)"
    print(f"gpu_check on {name}, torch {torch.__version__}, megatron-core {_megatron_core()}, "
          f"{env.repeats} repeats per kernel", flush=True)
    try:
        for check, rows_of in planned:
            table.check(check, rows_of)
    finally:
        table.print()
    return 1 if any(r.failed for r in table.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
