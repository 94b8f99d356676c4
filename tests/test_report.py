"""report.html from real fingerprint files and real comparisons."""
from __future__ import annotations

import re
from html.parser import HTMLParser

from test_compare import SCOPE, write_run  # the fingerprint-file writer shared with the compare tests

from megatron_bitdet.analysis.compare import compare_runs
from megatron_bitdet.analysis.report import RunSpec, Verdict, render_report

TAX = {"tax_percent": 2.4,
       "step_time_ms": {"deterministic": {"median": 41.0, "p10": 40.1, "p90": 43.0},
                        "baseline": {"median": 40.0, "p10": 39.5, "p90": 41.2}},
       "op_groups_ms": {"deterministic": {"matmul": 20.0, "embedding_bwd": 3.0}, "baseline": {"matmul": 20.1}},
       "comm_ms": {"deterministic": 4.0, "baseline": 3.9},
       "peak_memory_mib": {"deterministic": 512.0, "baseline": 500.0}}


class _Tags(HTMLParser):
    """Counts tags and checks nesting, a cheap 'is this HTML well-formed' check."""

    VOID = {"img", "meta", "br"}

    def __init__(self):
        super().__init__()
        self.stack, self.counts, self.errors = [], {}, []

    def handle_starttag(self, tag, attrs):
        self.counts[tag] = self.counts.get(tag, 0) + 1
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)


def _parse(path):
    text = path.read_text()
    p = _Tags()
    p.feed(text)
    assert not p.errors and not p.stack, (p.errors, p.stack)
    return text, p.counts


def test_report_with_a_broken_guarantee(tmp_path):
    a = write_run(tmp_path / "a", steps=6)
    b = write_run(tmp_path / "b", steps=6)
    resumed = write_run(tmp_path / "resumed", steps=6, nudge=(0, 4))
    results = {"A vs B": compare_runs(a, b), "A vs resumed": compare_runs(a, resumed)}
    verdicts = [Verdict("independent reproducibility", results["A vs B"].verdict == "match", "6 steps equal"),
                {"guarantee": "bitwise checkpoint resume", "holds": results["A vs resumed"].verdict == "match",
                 "evidence": "first divergence at step 4"}]
    out = render_report(tmp_path / "out" / "report.html", title="prove <tiny>", verdicts=verdicts,
                        runs=[RunSpec("A", str(a)), RunSpec("B", str(b)),
                              {"label": "resumed", "path": str(resumed), "resume_steps": (3,)}],
                        compare_results=results, tax=TAX)
    text, counts = _parse(out)
    assert counts["img"] == 1 + len(results) + 1  # metrics, one bit-distance plot per comparison, tax
    assert len(re.findall(r"src='data:image/png;base64,iVBORw0KGgo", text)) == counts["img"]
    rows = re.findall(r"<tr class='verdict (\w+)'><td>([^<]*)</td><td class='status'>(\w+)</td>", text)
    assert rows == [("holds", "independent reproducibility", "holds"),
                    ("broken", "bitwise checkpoint resume", "BROKEN")]
    assert "1 of 2 guarantees BROKEN" in text and "prove &lt;tiny&gt;" in text
    assert "diverged</b> at step <b>4</b>" in text and "+2.4%" in text
    assert "<td>torch_threads</td>" in text


def test_report_all_holding_without_tax(tmp_path):
    one = {**SCOPE, "world_size": 1}
    a, b = write_run(tmp_path / "a", ranks=1, scope=one), write_run(tmp_path / "b", ranks=1, scope=one)
    out = render_report(tmp_path / "report.html", title="t", verdicts=[Verdict("reproducible", True, "ok")],
                        runs=[RunSpec("A", str(a)), RunSpec("B", str(b))],
                        compare_results={"A vs B": compare_runs(a, b)},
                        extra_sections=[{"title": "notes", "body": "x < y"}])
    text, counts = _parse(out)
    assert counts["img"] == 2 and "every guarantee holds" in text and "BROKEN" not in text
    assert "<pre>x &lt; y</pre>" in text


def test_report_says_incomplete_where_compare_does(tmp_path):
    """Run B stopped after step 4 of 6: the comparison is incomplete, and the report must not say match."""
    a, b = write_run(tmp_path / "a", steps=6), write_run(tmp_path / "b", steps=4)
    result = compare_runs(a, b)
    assert result.verdict == "incomplete"
    out = render_report(tmp_path / "report.html", title="t", verdicts=[Verdict("reproducible", False, "short")],
                        runs=[RunSpec("A", str(a)), RunSpec("B", str(b))], compare_results={"A vs B": result})
    text, _ = _parse(out)
    assert "<b>incomplete</b>: 4 steps" in text and "only in A: 5-6; only in B: none" in text
    assert "<b>match</b>" not in text and "bit for bit." not in text


def test_step_axes_tick_at_whole_steps(tmp_path, monkeypatch):
    """A 3-step run: every plot with a step axis shows ticks at whole steps only (matplotlib's default
    locator put them at 1.25, 1.5, 1.75 ...), read from the figures the page embeds, as drawn."""
    from megatron_bitdet.analysis import report

    figures = []
    draw = report._img
    monkeypatch.setattr(report, "_img", lambda fig: figures.append(fig) or draw(fig))
    a, b = write_run(tmp_path / "a", steps=3), write_run(tmp_path / "b", steps=3)
    resumed = write_run(tmp_path / "r", steps=3, nudge=(0, 3))
    render_report(tmp_path / "report.html", title="t", verdicts=[Verdict("reproducible", True, "ok")],
                  runs=[RunSpec("A", str(a)), RunSpec("B", str(b)), RunSpec("resumed", str(resumed), (2,))],
                  compare_results={"A vs B": compare_runs(a, b), "A vs resumed": compare_runs(a, resumed)}, tax=TAX)
    step_figures = [fig for fig in figures if any(ax.get_xlabel().startswith("step") for ax in fig.axes)]
    assert len(step_figures) == 3  # the metrics panels (one x axis, shared) and the two bit-distance plots
    step_axes = [ax for fig in step_figures for ax in fig.axes]
    for ax in step_axes:
        lo, hi = sorted(ax.get_xlim())
        shown = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert shown and all(float(t).is_integer() for t in shown), (ax.get_ylabel(), shown)
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert all(label.lstrip("−-").isdigit() for label in labels), labels
