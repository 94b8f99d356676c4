"""bitdet prove end to end on the tiny hybrid (real 2-rank gloo launches), holding and broken.

The broken case plants a real order nondeterminism the enforcement cannot see (a provider that turns
torch's deterministic algorithms off is refused at setup): examples.planted_nondeterminism's split-K
GEMM whose partial products are summed in an order drawn from os.urandom, like GPU atomics.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_bitdet.cli import main

RECIPE = "recipes/nemotron_h_tiny.yaml"
SHORT = ["training.iterations=6"]
REPO = Path(__file__).resolve().parents[1]


def _verdict_rows(html: str) -> list[tuple[str, str]]:
    return re.findall(r"<tr class='verdict (holds|broken)'><td>([^<]*)</td>", html)


def test_prove_holds_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = main(["prove", "--recipe", RECIPE, "--out", str(out), "--resume-at", "3", "--tax-rounds", "2", "--json",
               *SHORT])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    html = (out / "report.html").read_text()
    rows = _verdict_rows(html)
    assert [state for state, _ in rows] == ["holds", "holds"]
    assert "independent reproducibility" in rows[0][1] and "checkpoint resume" in rows[1][1]
    assert "Determinism tax" in html and "every guarantee holds" in html
    assert f"report: {out / 'report.html'}" in printed.replace("\n", "")
    import json

    payload = json.loads((out / "prove.json").read_text())
    assert payload["holds"] and payload["tax"]["deterministic"]["det_algorithms_enabled"] == [True]
    assert payload["resume"]["resume_at"] == [3]


def test_prove_broken_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the ranks import the example provider
    monkeypatch.chdir(REPO)
    out = tmp_path / "broken"
    rc = main(["prove", "--recipe", RECIPE, "--out", str(out), "--resume-at", "3", "--no-tax",
               "--model-provider", "examples.planted_nondeterminism:provider", *SHORT])
    printed = capsys.readouterr().out
    assert rc == 1, printed[-3000:]
    rows = _verdict_rows((out / "report.html").read_text())
    assert rows[0][0] == "broken" and "independent reproducibility" in rows[0][1]
    assert "BROKEN" in printed


def test_prove_bad_input_exits_2(tmp_path):
    assert main(["prove", "--recipe", RECIPE, "--out", str(tmp_path), "--resume-at", "9", *SHORT]) == 2
    assert main(["prove", "--recipe", RECIPE, "--out", str(tmp_path), "--resume-at", "x"]) == 2
    assert main(["prove", "--recipe", str(tmp_path / "missing.yaml"), "--out", str(tmp_path)]) == 2
