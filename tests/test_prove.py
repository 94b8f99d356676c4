"""bitdet prove end to end on the tiny hybrid (real 2-rank gloo launches), holding and broken.

The broken case plants a real order nondeterminism the enforcement cannot see (a provider that turns
torch's deterministic algorithms off is refused at setup): examples.planted_nondeterminism's split-K
GEMM whose partial products are summed in an order drawn from os.urandom, like GPU atomics.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

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
    assert [state for state, _ in rows] == ["holds", "holds", "holds"]
    assert "independent reproducibility" in rows[0][1] and "checkpoint resume" in rows[1][1]
    assert "replicas agree within run A" in rows[2][1]
    # the replica check's evidence: what it covered, and what the distributed optimizer leaves uncoverable
    assert "replica-chunks" in html and "not coverable in this layout (one holder): grads 0.dense.0" in html
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


class QueuedDevice:
    """Stand-in for a CUDA device (absent here): kernels launch asynchronously and queue up;
    ``synchronize`` (and a copy to host, as the grads digest does) waits until the queue is done."""

    def __init__(self, monkeypatch):
        self.queued_s, self.syncs = 0.0, 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)

    def launch(self, seconds: float) -> None:
        self.queued_s += seconds

    def synchronize(self, device=None) -> None:
        self.syncs += 1
        time.sleep(self.queued_s)
        self.queued_s = 0.0


def test_step_clock_counts_the_queued_backward_and_bitdets_digests_in_the_step(tmp_path, monkeypatch):
    """On a GPU the backward is still queued when bitdet launches its grads digests (device-resident,
    no host read): nothing is subtracted, and the synchronized boundaries put that queued work in the
    step (the old clock subtracted an unsynchronized span around the digest's host copy)."""
    from megatron_bitdet.megatron_lm.timings import StepClock, read_step_times

    device = QueuedDevice(monkeypatch)
    clock = StepClock(tmp_path, 0)
    assert not hasattr(clock, "excluded")  # no span of the step is left out of its time
    clock.start()
    device.launch(0.2)  # forward + backward, launched, not finished
    device.launch(0.05)  # bitdet's digests, launched after them
    clock.stop(1)
    clock.close()
    assert device.syncs == 2  # start and stop
    assert read_step_times(tmp_path, 1)[0][1] >= 0.25


def test_step_timings_reader_takes_what_the_clock_writes_and_names_every_defect(tmp_path):
    """The Megatron-LM tax reads RUN_DIR/timings/: whole lines of every rank, or a refusal naming file:line."""
    from megatron_bitdet.errors import BitdetInputError
    from megatron_bitdet.megatron_lm.timings import StepClock, read_step_times
    from megatron_bitdet.rundir import timings_path

    for rank in (0, 1):
        clock = StepClock(tmp_path, rank)
        for step in (1, 2):
            clock.start()
            clock.stop(step)
        clock.close()
    times = read_step_times(tmp_path, 2)
    assert sorted(times) == [0, 1] and all(sorted(t) == [1, 2] and min(t.values()) >= 0 for t in times.values())
    path = timings_path(tmp_path, 1)
    good = path.read_bytes()
    bad = {b'{"v": 1, "step": 3, "rank": 0, "seconds": 0.1}\n': ":3: not a step timing of rank 1",
           b'{"v": 1, "step": 2, "rank": 1, "seconds": 0.1}\n': ":3: step 2 timed twice",
           b'\xff\xfe\n': ":3: not a JSON line",
           b'{"v": 1, "step": 3': ":3: truncated line"}
    for tail, message in bad.items():
        path.write_bytes(good + tail)
        with pytest.raises(BitdetInputError, match=re.escape(f"{path}{message}")):
            read_step_times(tmp_path, 2)
    path.unlink()
    with pytest.raises(BitdetInputError, match="no step timings for rank 1"):
        read_step_times(tmp_path, 2)
