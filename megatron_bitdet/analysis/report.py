"""One self-contained report.html: verdicts first, then the evidence as pictures.

Everything is inline (CSS, PNGs as base64) so the file can be mailed or attached to a ticket
and still open anywhere. Inputs are plain dataclasses / dicts so `bitdet prove` can feed it.

`tax` (all keys optional), times in ms, memory in MiB:
    {"tax_percent": 2.1,
     "step_time_ms": {"deterministic": {"median": m, "p10": lo, "p90": hi}, "baseline": {...}},
     "op_groups_ms": {"deterministic": {"matmul": ms, ...}, "baseline": {...}},
     "comm_ms": {"deterministic": ms, "baseline": ms},
     "peak_memory_mib": {"deterministic": mib, "baseline": mib}}
"""
from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, fields
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megatron_bitdet.analysis.compare import CompareResult
from megatron_bitdet.analysis.fingerprints_io import load_run
from megatron_bitdet.analysis.run_data import RunData
from megatron_bitdet.fingerprint.floatbits import decode_float
from megatron_bitdet.fingerprint.steps import DIGEST_PREFIX

PLOTTED_METRICS = ("loss", "lm_loss", "lm loss", "aux_loss", "load_balancing_loss", "mtp_loss", "grad_norm",
                   "grad-norm")
SIDES = ("deterministic", "baseline")
SIDE_COLORS = ["tab:blue", "tab:gray"]


@dataclass
class Verdict:
    guarantee: str
    holds: bool
    evidence: str


@dataclass
class RunSpec:
    """A run to plot; resume_steps are the steps a checkpoint was restored after (drawn as markers)."""

    label: str
    path: str
    resume_steps: tuple[int, ...] = ()


@dataclass
class Section:
    """Extra text shown preformatted at the end (e.g. a localize result)."""

    title: str
    body: str


def _coerce(cls, item):
    return item if isinstance(item, cls) else cls(**{f.name: item[f.name] for f in fields(cls) if f.name in item})


def render_report(out_path, *, title: str, verdicts, runs, compare_results, tax=None, extra_sections=()) -> Path:
    """Write the report; compare_results maps a label ("A vs B") to a CompareResult."""
    verdicts = [_coerce(Verdict, v) for v in verdicts]
    specs = [_coerce(RunSpec, r) for r in runs]
    loaded = [(s, load_run(s.path, allow_truncated=True)) for s in specs]
    body = [f"<h1>{_e(title)}</h1>", _verdict_table(verdicts)]
    if loaded:
        body += ["<h2>Per-step metrics</h2>", _img(_metrics_figure(loaded))]
    if compare_results:
        body.append("<h2>Bit distance per step</h2>")
        for label, result in compare_results.items():
            body += [f"<h3>{_e(label)}</h3>", _compare_summary(result), _img(_distance_figure(label, result))]
    if tax:
        body += ["<h2>Determinism tax</h2>", _tax_text(tax), _img(_tax_figure(tax))]
    body += _scope_section(loaded)
    for sec in (_coerce(Section, s) for s in extra_sections):
        body += [f"<h2>{_e(sec.title)}</h2>", f"<pre>{_e(sec.body)}</pre>"]
    warnings = [w for _, run in loaded for w in run.warnings]
    if warnings:
        body += ["<h2>Warnings</h2>", "<ul>" + "".join(f"<li>{_e(w)}</li>" for w in warnings) + "</ul>"]
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{_e(title)}</title>"
                   f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>\n", encoding="utf-8")
    return out


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}
th{background:#f3f3f3}tr.verdict.holds td.status{background:#d9f2d9;color:#185c18;font-weight:bold}
tr.verdict.broken td.status{background:#f8d4d4;color:#8a1010;font-weight:bold}
tr.differs td{background:#fff3cd}.banner{font-size:1.3em;padding:.5em;border-radius:4px}
.banner.holds{background:#d9f2d9}.banner.broken{background:#f8d4d4}img{max-width:100%}
pre{background:#f7f7f7;padding:.6em;overflow-x:auto}code{font-size:.9em}"""


def _e(x) -> str:
    return html.escape(str(x))


def _verdict_table(verdicts: list[Verdict]) -> str:
    if not verdicts:
        return ""
    broken = sum(not v.holds for v in verdicts)
    state = "broken" if broken else "holds"
    banner = f"{broken} of {len(verdicts)} guarantees BROKEN" if broken else "every guarantee holds"
    rows = "".join(
        f"<tr class='verdict {'holds' if v.holds else 'broken'}'><td>{_e(v.guarantee)}</td>"
        f"<td class='status'>{'holds' if v.holds else 'BROKEN'}</td><td>{_e(v.evidence)}</td></tr>"
        for v in verdicts)
    return (f"<p class='banner {state}'>{banner}</p><table><tr><th>guarantee</th><th>verdict</th>"
            f"<th>evidence</th></tr>{rows}</table>")


def _img(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return f"<img alt='plot' src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}'>"


def _series(run: RunData, name: str) -> tuple[list[int], list[float]]:
    """A metric of the lowest rank (losses are all-reduced; the plot shows the trajectory)."""
    records = [r for r in run.ranks[min(run.ranks)] if name in r.metrics]
    return [r.step for r in records], [decode_float(r.metrics[name]) for r in records]


def _integer_steps(ax) -> None:
    """Steps are whole numbers: without this a 3-step run's axis ticks at 1.25, 1.5, 1.75."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _metrics_figure(loaded: list[tuple[RunSpec, RunData]]) -> Figure:
    names = [n for n in PLOTTED_METRICS if any(_series(run, n)[0] for _, run in loaded)]
    fig = Figure(figsize=(10, 2.6 * max(1, len(names))))
    axes = fig.subplots(max(1, len(names)), 1, sharex=True, squeeze=False)[:, 0]
    for ax, name in zip(axes, names):
        for i, (spec, run) in enumerate(loaded):
            steps, values = _series(run, name)
            # later runs drawn thinner and dashed so identical trajectories stay visible on top of each other
            line, = ax.plot(steps, values, lw=3.0 - 2.0 * i / max(1, len(loaded) - 1), ls=("-", "--", ":")[i % 3],
                            label=spec.label)
            for s in spec.resume_steps:
                ax.axvline(s, color=line.get_color(), ls=":", lw=1)
                if s in steps:
                    ax.plot([s], [values[steps.index(s)]], marker="v", ms=9, color=line.get_color())
        ax.set_ylabel(name)
        ax.legend(loc="upper right", fontsize="small")
        _integer_steps(ax)
    axes[-1].set_xlabel("step  (▼ / dotted: resumed from a checkpoint after this step)")
    return fig


def _distance_figure(label: str, result: CompareResult) -> Figure:
    fig = Figure(figsize=(10, 3))
    ax = fig.subplots()
    steps = [s.step for s in result.per_step]
    for name in result.metrics_compared:
        ys = [s.max_ulp.get(name) for s in result.per_step]
        ax.plot(steps, [y if y is not None else float("nan") for y in ys], marker=".", label=name)
    flagged = [s.step for s in result.per_step if any(n.startswith(DIGEST_PREFIX) for n in s.differing)
               or None in s.max_ulp.values()]
    top = max([y for s in result.per_step for y in s.max_ulp.values() if y] or [1])
    if flagged:
        ax.plot(flagged, [top * 2] * len(flagged), "rx", ms=9, label="digest differs / not comparable")
    ax.set_yscale("symlog", linthresh=1)  # log scale that still has an exact 0
    ax.axhline(0, color="green", lw=2)
    ax.set_ylim(-0.3, top * 4)
    if not result.diverged_steps:
        equal, color = ((f"0 ULP at every step: bitwise equal ({result.steps_compared} steps)", "green")
                        if result.verdict == "match" else
                        (f"0 ULP at the {result.steps_compared} common steps, but incomplete: not a match", "red"))
        ax.text(0.5, 0.5, equal, transform=ax.transAxes, ha="center", color=color, fontsize=12)
    ax.set(title=f"{label}: max ULP distance across ranks", xlabel="step", ylabel="ULP (symlog, 0 = equal)")
    _integer_steps(ax)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return fig


def _compare_summary(r: CompareResult) -> str:
    what = (f"{r.steps_compared} steps × {len(r.ranks_compared)} ranks × {len(r.metrics_compared)} metrics "
            f"+ {len(r.digests_compared)} digests")
    if r.verdict == "match":
        return f"<p><b>match</b>: {what}, bit for bit.</p>"
    if r.verdict == "incomplete":
        why = f"steps missing: {r.missing_steps()}" if r.lengths_differ else f"cut short: {', '.join(r.truncated)}"
        return f"<p><b>incomplete</b>: {what} bit for bit equal, but {_e(why)}: not a match.</p>"
    if r.first_divergence is None:
        return f"<p><b>{_e(r.verdict)}</b>: {_e(r.error or 'nothing was compared')}</p>"
    d = r.first_divergence
    rows = "".join(
        f"<tr><td>{_e(x.name)}</td><td>{x.rank}</td><td><code>{_e(x.a_value if x.ulp is not None else x.a)}</code>"
        f"</td><td><code>{_e(x.b_value if x.ulp is not None else x.b)}</code></td>"
        f"<td>{_e(f'{x.ulp} ulp, bit {x.first_bit}' if x.ulp is not None else x.note)}</td></tr>"
        for x in d.details[:20])
    return (f"<p><b>diverged</b> at step <b>{d.step}</b> ({what}); {len(r.diverged_steps)} differing steps "
            f"in all.</p><table><tr><th>metric</th><th>rank</th><th>A</th><th>B</th><th>distance</th></tr>"
            f"{rows}</table>")


def _tax_text(tax: dict) -> str:
    pct = tax.get("tax_percent")
    return f"<p>determinism tax: <b>{pct:+.1f}%</b> step time vs the baseline</p>" if pct is not None else ""


def _tax_figure(tax: dict) -> Figure:
    panels = [k for k in ("step_time_ms", "op_groups_ms", "comm_ms", "peak_memory_mib") if tax.get(k)]
    fig = Figure(figsize=(4 * max(1, len(panels)), 3.2))
    axes = fig.subplots(1, max(1, len(panels)), squeeze=False)[0]
    for ax, key in zip(axes, panels):
        data = tax[key]
        if key == "step_time_ms":
            med = [data[s]["median"] for s in SIDES]
            err = [[m - data[s].get("p10", m) for s, m in zip(SIDES, med)],
                   [data[s].get("p90", m) - m for s, m in zip(SIDES, med)]]
            ax.bar(SIDES, med, yerr=err, capsize=6, color=SIDE_COLORS)
            ax.set_title("step time (median, p10–p90)")
        elif key == "op_groups_ms":
            groups = sorted(set(data.get(SIDES[0], {})) | set(data.get(SIDES[1], {})))
            for j, side in enumerate(SIDES):
                ax.bar([g + j * 0.4 for g in range(len(groups))], [data.get(side, {}).get(g, 0) for g in groups],
                       width=0.4, label=side, color=SIDE_COLORS[j])
            ax.set_xticks([g + 0.2 for g in range(len(groups))], groups, rotation=30, ha="right")
            ax.legend(fontsize="small")
            ax.set_title("time per op group")
        else:
            ax.bar(SIDES, [data.get(s, 0) for s in SIDES], color=SIDE_COLORS)
            ax.set_title("exposed comm time" if key == "comm_ms" else "peak memory")
        ax.set_ylabel("MiB" if key == "peak_memory_mib" else "ms")
    return fig


def _scope_section(loaded: list[tuple[RunSpec, RunData]]) -> list[str]:
    scopes = [(spec.label, run.manifest["scope"]) for spec, run in loaded if run.manifest]
    if not scopes:
        return ["<h2>Validation scope</h2><p>no manifests (e.g. TensorBoard logs): scope not recorded</p>"]
    keys = sorted({k for _, sc in scopes for k in sc})
    head = "".join(f"<th>{_e(label)}</th>" for label, _ in scopes)
    rows = []
    for k in keys:
        vals = [sc.get(k, "—") for _, sc in scopes]
        cls = " class='differs'" if any(v != vals[0] for v in vals) else ""
        rows.append(f"<tr{cls}><td>{_e(k)}</td>" + "".join(f"<td>{_e(v)}</td>" for v in vals) + "</tr>")
    return ["<h2>Validation scope</h2><p>Bitwise equality holds within one scope; differing keys are "
            "highlighted.</p>", f"<table><tr><th>key</th>{head}</tr>{''.join(rows)}</table>"]
