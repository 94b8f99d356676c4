"""The kernel rung: replay one captured op occurrence in isolation and name its mechanism.

A fresh interpreter (``python -m megatron_bitdet.analysis.kernel_replay``) loads the capture, imports
a custom op's defining module, and runs the op N times on rebuilt copies of the identical inputs
under several configurations: the recorded thread count and torch flag, 1 thread, other thread
counts, torch's deterministic algorithms, contiguous instead of the recorded strides. Distinct
output digests are counted per configuration; on a GPU each configuration's kernel names are taken
from the profiler. From the counts, and from comparing the two runs' captured arguments, a verdict
names the mechanism (an id of the known-sources catalog) and whether torch has a deterministic variant.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_bitdet.errors import BitdetError, BitdetInputError

DEFAULT_REPEATS = 20
THREAD_ORDER, IN_KERNEL, RUNTIME_CONFIG, ISOLATED_DETERMINISTIC = (
    "thread_scheduling", "order_inside_kernel", "runtime_configuration", "deterministic_in_isolation")


@dataclass
class ReplayConfig:
    label: str
    threads: int
    deterministic: bool
    strided: bool = True
    repeats: int = 0
    distinct: int = 0
    matches_a: int = 0            # repeats whose outputs equal run A's captured outputs bit for bit
    matches_b: int = 0
    error: str = ""
    kernels: list = field(default_factory=list)  # GPU only: each distinct launch list (kernel grid block) seen


@dataclass
class KernelVerdict:
    op: str
    event_id: str
    rank: int
    mechanism: str                # catalog mechanism id
    deterministic_variant: str    # "yes" | "no" | "refuses" | "n/a"
    verdict: str                  # one line: op, counts, mechanism
    configs: list = field(default_factory=list)
    evidence: list = field(default_factory=list)
    captures: list = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- worker (fresh process)


def _resolve_op(name: str):
    import torch

    ns, _, rest = name.partition(".")
    op, _, overload = rest.rpartition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError):
        raise BitdetInputError(f"op {name!r} is not registered in the replay process") from None


def _register_custom_op(rec: dict, path: str):
    """The captured op; a custom op not registered yet is registered by importing the module the capture
    names as its home. The capture is untrusted input: that happens only for a non-ATen op, the name must
    be a module path, the current directory goes last on sys.path (a capture can name a module, never
    shadow one), and the import must register the op."""
    import importlib

    op, home = rec["op"], rec.get("home")
    if not isinstance(op, str):
        raise BitdetInputError(f"{path}: 'op' is {op!r}, not an op name")
    try:
        return _resolve_op(op)
    except BitdetInputError:
        if op.partition(".")[0] in ("aten", "prims") or not home:
            raise
    if not isinstance(home, str) or not all(part.isidentifier() for part in home.split(".")):
        raise BitdetInputError(f"{path}: 'home' is {home!r}, not a module path")
    sys.path.append(os.getcwd())
    print(f"[replay-op] importing {home} (the module the capture names for {op})", file=sys.stderr, flush=True)
    try:
        importlib.import_module(home)
    except ImportError as exc:
        raise BitdetInputError(f"{path}: the op's module {home!r} is not importable here ({exc}); run from "
                               "the directory the run was launched in") from None
    return _resolve_op(op)


def _digests(out) -> str:
    """Exact digests of every output tensor (dtype, shape, bytes)."""
    from megatron_bitdet.fingerprint.tensor import dtype_name, exact_digest
    from megatron_bitdet.trace.digest import trace_tensors

    return "|".join(f"{dtype_name(t.dtype)}{list(t.shape)}:"
                    f"{exact_digest(t.detach().contiguous()) if t.numel() else 'empty'}" for t in trace_tensors(out))


def _configs(rec: dict, threads: list[int]) -> list[ReplayConfig]:
    t0, det0 = rec["threads"], bool(rec["deterministic_algorithms"])
    out = [ReplayConfig(f"as recorded ({t0} threads)", t0, det0)]
    out += [ReplayConfig(f"{n} thread{'s' if n > 1 else ''}", n, det0) for n in threads if n != t0]
    out.append(ReplayConfig(f"deterministic algorithms ({t0} threads)", t0, True))
    out.append(ReplayConfig(f"contiguous inputs ({t0} threads)", t0, det0, strided=False))
    return out


def _profiled(func, args, kwargs, trace_file: Path):
    """GPU only (written, not run on the CPU machines this was built on): one call under the profiler;
    the kernels it launched with their grid / block, from the exported trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = func(*args, **kwargs)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_file))
    events = json.loads(trace_file.read_text()).get("traceEvents", [])
    launched = [f"{e['name']} grid={e.get('args', {}).get('grid')} block={e.get('args', {}).get('block')}"
                for e in events if e.get("cat") == "kernel"]
    return out, launched


def replay_worker(path: str, out_path: str, repeats: int, threads: list[int], other: str | None = None) -> None:
    """Runs in the fresh process: every configuration, ``repeats`` times each, results to JSON."""

    import torch

    from megatron_bitdet.trace.capture import decode, load_capture, rebuild

    rec = load_capture(path)
    func = _register_custom_op(rec, path)
    captured = _digests([rebuild(t, strided=False) for t in rec.get("outputs", [])])
    cuda = any(t["device"].startswith("cuda") for t in rec["inputs"])
    results = []
    for cfg in _configs(rec, threads):
        torch.set_num_threads(cfg.threads)
        torch.use_deterministic_algorithms(cfg.deterministic)
        seen = set()
        try:
            for _ in range(repeats):
                ins = [rebuild(t, cfg.strided) for t in rec["inputs"]]
                args, kwargs = decode(rec["args"], ins), decode({"dict": rec["kwargs"]}, ins)
                if cuda:
                    out, launched = _profiled(func, args, kwargs, Path(out_path).with_suffix(".trace.json"))
                    if launched not in cfg.kernels:
                        cfg.kernels.append(launched)
                else:
                    out = func(*args, **kwargs)
                d = _digests(out)
                seen.add(d)
                cfg.repeats += 1
                cfg.matches_a += d == captured
                cfg.matches_b += d == other
        except RuntimeError as exc:
            cfg.error = str(exc).splitlines()[0][:300]
        cfg.distinct = len(seen)
        results.append(asdict(cfg))
    Path(out_path).write_text(json.dumps({"op": rec["op"], "configs": results}))


# ----------------------------------------------------------------------------- parent side


def _tensor_equal(x: dict, y: dict) -> bool:
    import torch

    if "data" not in x or "data" not in y:
        return False
    a, b = x["data"], y["data"]
    return (a.dtype == b.dtype and a.shape == b.shape and x["stride"] == y["stride"]
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _arg_label(rec: dict, i: int) -> str:
    names = rec["arg_names"]
    return names[i] if i < len(names) else f"arg{i}"


def compare_captures(a: dict, b: dict) -> list[str]:
    """What differs between the two runs' captured arguments (empty: identical op inputs)."""
    out = []
    for i, (x, y) in enumerate(zip(a["args"], b["args"])):
        if x != y:
            out.append(f"{_arg_label(a, i)}: {x!r} vs {y!r}")
    for k in sorted(set(a["kwargs"]) | set(b["kwargs"])):
        if a["kwargs"].get(k) != b["kwargs"].get(k):
            out.append(f"{k}: {a['kwargs'].get(k)!r} vs {b['kwargs'].get(k)!r}")
    if len(a["args"]) != len(b["args"]):
        out.append(f"{len(a['args'])} vs {len(b['args'])} arguments")
    ins_a, ins_b = a.get("inputs", []), b.get("inputs", [])
    for i, (x, y) in enumerate(zip(ins_a, ins_b)):
        if not _tensor_equal(x, y):
            out.append(f"input tensor {i}: bytes differ")
    return out


def _flags(rec: dict) -> str:
    """Non-default boolean arguments, e.g. '(accumulate)' for index_put with accumulate=True."""
    on = [_arg_label(rec, i) for i, v in enumerate(rec.get("args", [])) if v is True]
    on += [k for k, v in rec.get("kwargs", {}).items() if v is True]
    return f" ({', '.join(on)})" if on else ""


def _run_worker(path: Path, other_digest: str | None, repeats: int, threads: list[int]) -> dict:
    """The replay in a fresh interpreter (the op's own process state never leaks into the counts)."""
    out = Path(tempfile.mkdtemp(prefix="bitdet_replay_")) / "replay.json"
    # -P: no current directory first on sys.path (the worker appends it, last, for a custom op's module)
    proc = subprocess.run([sys.executable, "-P", "-m", "megatron_bitdet.analysis.kernel_replay", str(path), str(out),
                           str(repeats), ",".join(map(str, threads)), *([other_digest] if other_digest else [])],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode == 2:
        raise BitdetInputError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"{path}: replay refused")
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise BitdetError(f"replay of {path} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def _output_digest(rec: dict) -> str | None:
    from megatron_bitdet.trace.capture import rebuild

    if "outputs" not in rec:
        return None
    return _digests([rebuild(t, strided=False) for t in rec["outputs"]])


def replay_op(capture_a, capture_b=None, *, repeats: int = DEFAULT_REPEATS, threads=None) -> KernelVerdict:
    """Replay run A's captured occurrence (compared with run B's, when given) and name the mechanism."""
    from megatron_bitdet.trace.capture import load_capture

    a = load_capture(capture_a)
    b = load_capture(capture_b) if capture_b else None
    if repeats < 2:
        raise BitdetInputError(f"replay repeats {repeats}: need at least 2 to count distinct results")
    for rec, path in ((a, capture_a), (b, capture_b)):
        if rec is not None and ("unsupported" in rec or "too_large" in rec):
            raise BitdetInputError(f"{path}: nothing to replay: {rec.get('unsupported') or rec.get('too_large')}")
    threads = sorted(set(threads or [1, a["threads"], max(2, os.cpu_count() or 1)]))
    evidence = []
    differs = []
    if b is not None:
        if a["op"] != b["op"] or a["event_id"] != b["event_id"]:
            raise BitdetInputError(f"{capture_b}: captured {b['event_id']} ({b['op']}), run A captured "
                                   f"{a['event_id']} ({a['op']}): not the same occurrence")
        differs = compare_captures(a, b)
        same_out = _output_digest(a) == _output_digest(b)
        evidence.append("captured inputs identical in both runs" if not differs
                        else "captured arguments differ between the runs: " + "; ".join(differs))
        evidence.append("captured outputs " + ("identical" if same_out else "differ") + " between the runs")
    data = _run_worker(Path(capture_a), _output_digest(b) if b is not None else None, repeats, threads)
    configs = [ReplayConfig(**c) for c in data["configs"]]
    return _verdict(a, b, configs, differs, evidence, [str(capture_a)] + ([str(capture_b)] if capture_b else []))


def _verdict(a: dict, b, configs: list[ReplayConfig], differs: list[str], evidence: list[str], paths) -> KernelVerdict:
    rec_cfg = configs[0]
    det = next(c for c in configs if c.label.startswith("deterministic"))
    contig = next(c for c in configs if not c.strided)
    plain = [c for c in configs if c.strided and c is not det]  # the recorded flag, thread counts varied
    one = next((c for c in plain if c.threads == 1), None)
    multi = [c for c in plain if c.threads > 1]
    varies = [c for c in multi if c.distinct > 1]
    op = a["op"] + _flags(a)
    counts = [f"{rec_cfg.distinct} distinct results in {rec_cfg.repeats} repeats at {rec_cfg.threads} threads"
              + (" (recorded with deterministic algorithms on)" if rec_cfg.deterministic else "")]
    counts += [f"{c.distinct} at {c.threads} threads" for c in multi if c is not rec_cfg]
    if one is not None and one is not rec_cfg:
        counts.append(f"{one.distinct} at 1 thread")
    if det.error:
        det_variant, det_text = "refuses", f"refused with deterministic algorithms ({det.error})"
        counts.append("refused with deterministic algorithms")
    else:
        counts.append(f"{det.distinct} with deterministic algorithms")
        det_variant = "yes" if det.distinct == 1 else "no"
    if contig.distinct and not contig.error:
        evidence.append(f"contiguous inputs: {contig.distinct} distinct in {contig.repeats} repeats")
    for c in configs:
        if c.error and c is not det:
            evidence.append(f"{c.label}: {c.error}")
        if c.kernels:
            evidence.append(f"{c.label}: kernels {'; '.join(c.kernels[0])}"
                            + (f" ({len(c.kernels)} different kernel choices across repeats)" if len(c.kernels) > 1 else ""))
    if b is not None and rec_cfg.repeats:
        evidence.append(f"replay at the recorded configuration reproduced run A's output in {rec_cfg.matches_a} and "
                        f"run B's in {rec_cfg.matches_b} of {rec_cfg.repeats} repeats")
    thread_dependent = bool(varies) and one is not None and one.distinct == 1
    if differs and not any(d.startswith("input tensor") for d in differs):
        mechanism = RUNTIME_CONFIG
        text = ("deterministic given its arguments, but the runs called it with different configurations ("
                + "; ".join(differs) + "): a choice made at run time (autotuning, timing- or state-based dispatch)"
                if all(c.distinct <= 1 for c in configs) else
                "the runs called it with different configurations (" + "; ".join(differs) + ")")
        det_variant = "n/a"
    elif thread_dependent:
        mechanism = THREAD_ORDER
        text = "a parallel accumulation whose order depends on thread scheduling; " + {
            "yes": "torch has a deterministic variant (torch.use_deterministic_algorithms(True))",
            "refuses": "torch has no deterministic variant (it raises under deterministic algorithms): run it "
                       "on one thread or replace it",
            "no": "torch's deterministic algorithms do not change it: run it on one thread or replace it"}[det_variant]
    elif any(c.distinct > 1 for c in configs):
        mechanism = IN_KERNEL
        text = ("it varies on one thread too: the order comes from inside the kernel (atomics, an unseeded or "
                "system-random order), not from thread scheduling; "
                + ("torch's deterministic algorithms make it deterministic" if det_variant == "yes" else
                   "torch has no deterministic variant: replace it with a fixed-order implementation"))
    else:
        mechanism = ISOLATED_DETERMINISTIC
        det_variant = "n/a"
        text = ("deterministic in isolation (every configuration gave one result): the divergence needs state "
                "outside its arguments (uninitialized or reused memory, a concurrent stream, global state)")
        if contig.distinct == 1 and rec_cfg.distinct == 1 and contig.matches_a != rec_cfg.matches_a:
            text += "; its result depends on the input strides"
    verdict = f"{op} — {', '.join(counts)}: {text}"
    return KernelVerdict(op=a["op"], event_id=a["event_id"], rank=a["rank"], mechanism=mechanism,
                         deterministic_variant=det_variant, verdict=verdict, configs=[asdict(c) for c in configs],
                         evidence=evidence, captures=list(paths))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path, out, repeats, threads, *other = argv
    try:
        replay_worker(path, out, int(repeats), [int(t) for t in threads.split(",")], other[0] if other else None)
    except BitdetInputError as exc:
        print(f"bitdet replay-op: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
