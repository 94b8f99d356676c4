"""`bitdet compare` on real fingerprint files (DESIGN.md format) and real TensorBoard event files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from megatron_bitdet.analysis.compare import ScopeMismatchError, compare_runs
from megatron_bitdet.analysis.fingerprints_io import load_run
from megatron_bitdet.cli import main
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.fingerprint.floatbits import encode_float

SCOPE = {"torch_version": torch.__version__, "device_kind": "cpu", "torch_threads": 2,
         "world_size": 2, "tp": 1, "pp": 1, "recipe_digest": "sha256:00ab", "deterministic_mode": True}


def _digest(t: torch.Tensor) -> str:
    return "xxh3_128:" + xxhash.xxh3_128_hexdigest(t.detach().contiguous().numpy().tobytes())


def trajectory(steps: int, seed: int, nudge_at: int | None = None):
    """Fingerprint lines of a tiny real float32 SGD run; nudge_at moves one weight by 1 ulp before that step."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, generator=g)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, generator=g)
    for step in range(1, steps + 1):
        if step == nudge_at:
            w[0] = torch.nextafter(w[0], torch.tensor(float("inf")))
        w.requires_grad_(True)
        lm_loss = ((x @ w - y) ** 2).mean()
        aux_loss = 0.01 * w.abs().sum()
        loss = lm_loss + aux_loss
        loss.backward()
        lr = 0.05
        yield {
            "metrics": {"loss": encode_float(loss), "lm_loss": encode_float(lm_loss),
                        "aux_loss": encode_float(aux_loss), "grad_norm": encode_float(w.grad.norm()),
                        "lr": encode_float(lr)},
            "digests": {"params": _digest(w), "grads": _digest(w.grad)},
        }
        with torch.no_grad():
            w = w - lr * w.grad


def write_run(root: Path, *, steps: int = 5, ranks: int = 2, scope=None, nudge=None, edit=None) -> Path:
    """A run dir written the way the training loop does: manifest.json + one flushed JSON line per step per rank.

    nudge=(rank, step) perturbs that rank's trajectory; edit(step, rank, line) may change a line in place.
    """
    (root / "fingerprints").mkdir(parents=True)
    manifest = {"bitdet_version": "0.1.0", "created": "2025-01-01T00:00:00Z", "recipe": {},
                "recipe_digest": SCOPE["recipe_digest"], "scope": dict(SCOPE if scope is None else scope),
                "env": {}, "rules": {"applied": [], "opt_outs": [], "swaps": []}, "patches": [], "argv": []}
    (root / "manifest.json").write_text(json.dumps(manifest))
    for rank in range(ranks):
        nudge_at = nudge[1] if nudge and nudge[0] == rank else None
        with open(root / "fingerprints" / f"rank_{rank:05d}.jsonl", "w") as f:
            for step, fp in enumerate(trajectory(steps, seed=rank, nudge_at=nudge_at), start=1):
                line = {"v": 1, "step": step, "rank": rank, **fp}
                if edit:
                    edit(step, rank, line)
                f.write(json.dumps(line) + "\n")
                f.flush()
    return root


def flip_low_bit(encoded: str) -> str:
    name, hexbits = encoded.split(":")
    return f"{name}:{int(hexbits, 16) ^ 1:0{len(hexbits)}x}"


def bitdet(*args):
    """The real console command in its own process (exit codes as a shell sees them)."""
    return subprocess.run([sys.executable, "-m", "megatron_bitdet", "compare", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def bitdet_inproc(capsys, *args):
    """The same command through cli.main in this process (no torch start-up per call)."""
    capsys.readouterr()
    code = main(["compare", *map(str, args)])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_identical_runs_match(tmp_path):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b")
    p = bitdet(a, b)
    assert p.returncode == 0, p.stderr
    assert "MATCH: 5 steps x 2 ranks x 5 metrics + 2 digests" in p.stdout


def test_single_flipped_low_bit_is_reported_exactly(tmp_path, capsys):
    def flip(step, rank, line):
        if (step, rank) == (3, 1):
            line["metrics"]["lm_loss"] = flip_low_bit(line["metrics"]["lm_loss"])

    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b", edit=flip)
    p = bitdet(a, b, "--json")
    assert p.returncode == 1, p.stderr
    out = json.loads(p.stdout)
    div = out["first_divergence"]
    assert out["verdict"] == "diverged"
    assert (div["step"], div["metrics"], div["ranks"]) == (3, ["lm_loss"], [1])
    [d] = div["details"]
    assert (d["rank"], d["name"], d["ulp"], d["first_bit"]) == (1, "lm_loss", 1, 31)
    assert d["a_value"] != d["b_value"] and f"{d['a_value']:.6g}" == f"{d['b_value']:.6g}"
    assert out["diverged_steps"] == [3]
    text = bitdet_inproc(capsys, a, b).stdout
    assert "DIVERGED at step 3" in text and "rank 1" in text and "(1 ulp, bit 31)" in text


def test_real_divergence_propagates_and_later_steps_are_summarized(tmp_path):
    a, b = write_run(tmp_path / "a", steps=6), write_run(tmp_path / "b", steps=6, nudge=(0, 3))
    r = compare_runs(a, b)
    assert r.verdict == "diverged" and r.exit_code == 1
    assert r.first_divergence.step == 3 and r.first_divergence.ranks == [0]
    assert "digest:params" in r.first_divergence.metrics
    assert r.diverged_steps == [3, 4, 5, 6]
    assert all(s.max_ulp["lr"] == 0 for s in r.per_step)
    assert r.per_step[0].max_ulp["loss"] == 0 and r.per_step[-1].max_ulp["loss"] > 0


def test_scope_mismatch_refused_unless_forced(tmp_path, capsys):
    a = write_run(tmp_path / "a")
    b = write_run(tmp_path / "b", scope={**SCOPE, "torch_threads": 1})
    p = bitdet(a, b)
    assert p.returncode == 2
    assert "torch_threads" in p.stderr and "--force" in p.stderr
    forced = bitdet_inproc(capsys, a, b, "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["scope_mismatches"] == [{"key": "torch_threads", "a": 2, "b": 1}]


def test_truncated_final_line(tmp_path, capsys):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b")
    f = b / "fingerprints" / "rank_00001.jsonl"
    data = f.read_bytes()
    f.write_bytes(data[: data.rstrip(b"\n").rfind(b"\n") + 40])  # crash in the middle of line 5
    p = bitdet(a, b)
    assert p.returncode == 2
    assert f"{f}:5" in p.stderr and "truncated" in p.stderr
    allowed = bitdet_inproc(capsys, a, b, "--allow-truncated")
    assert allowed.returncode == 1, allowed.stderr  # the steps before it match, but step 5 was not compared
    assert "INCOMPLETE:" in allowed.stdout and "steps missing: only in A: 5" in allowed.stdout


def test_foreign_file_and_missing_run(tmp_path, capsys):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b")
    (b / "fingerprints" / "rank_00000.jsonl").write_text("step,loss\n1,5.54\n")
    p = bitdet_inproc(capsys, a, b, "--json")
    assert p.returncode == 2
    assert json.loads(p.stdout)["verdict"] == "unusable"
    assert "rank_00000.jsonl:1: not a bitdet fingerprint file" in p.stderr
    missing = bitdet_inproc(capsys, a, tmp_path / "nope")
    assert missing.returncode == 2 and "no such run directory" in missing.stderr
    assert "Traceback" not in missing.stderr + p.stderr


@pytest.mark.parametrize("edit, message", [
    (lambda s, r, line: line.pop("step") if s == 2 else None, ":2: line is missing 'step'"),
    (lambda s, r, line: line.update(step=1) if s == 3 else None, ":3: steps out of order (step 1 after step 2)"),
    (lambda s, r, line: line["metrics"].update(loss="5.54") if s == 4 else None, ":4: metric 'loss' is not"),
])
def test_malformed_lines_name_file_and_line(tmp_path, edit, message):
    run = write_run(tmp_path / "a", ranks=1, edit=edit)
    with pytest.raises(BitdetInputError, match="rank_00000.jsonl" + message.replace("(", r"\(").replace(")", r"\)")):
        load_run(run)


def test_rank_file_missing_in_one_run(tmp_path):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b", ranks=1)
    with pytest.raises(BitdetInputError, match=r"rank 1 is missing \(fingerprints/rank_00001.jsonl\)"):
        compare_runs(a, b)
    assert compare_runs(a, b, ranks=[0]).verdict == "match"


def test_rank_missing_from_both_runs_is_refused(tmp_path, capsys):
    """Both manifests say world_size 2 and both runs lack rank 1: it was compared in neither."""
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b")
    for run in (a, b):
        (run / "fingerprints" / "rank_00001.jsonl").unlink()
    with pytest.raises(BitdetInputError, match=r"world_size is 2 .*rank\(s\) \[1\] .*rank_00001.jsonl"):
        compare_runs(a, b)
    p = bitdet_inproc(capsys, a, b)
    assert p.returncode == 2 and "MATCH" not in p.stdout and "rank_00001.jsonl" in p.stderr
    assert compare_runs(a, b, ranks=[0]).verdict == "match"  # asked for rank 0 only: compared in full


@pytest.mark.parametrize("gap", ["deleted", "emptied"])
def test_step_missing_from_both_runs_is_incomplete(tmp_path, capsys, gap):
    """Step 3's line deleted in both runs, or left holding no value in both: nothing was compared there."""
    def edit(step, rank, line):
        if step == 3:
            line["metrics"], line["digests"] = {}, {}

    a, b = (write_run(tmp_path / k, edit=edit if gap == "emptied" else None) for k in "ab")
    if gap == "deleted":
        for f in [*(a / "fingerprints").iterdir(), *(b / "fingerprints").iterdir()]:
            f.write_text("".join(x for x in f.read_text().splitlines(True) if '"step": 3,' not in x))
    r = compare_runs(a, b)
    assert (r.verdict, r.steps_compared, r.steps_in_neither) == ("incomplete", 4, [3])
    p = bitdet_inproc(capsys, a, b)
    assert p.returncode == 1 and "INCOMPLETE" in p.stdout and "in neither: 3" in p.stdout
    assert compare_runs(a, b, steps=[1, 2, 4, 5]).verdict == "match"


def test_forced_verdict_names_the_scope_keys_that_differ(tmp_path, capsys):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b", scope={**SCOPE, "torch_threads": 99})
    p = bitdet_inproc(capsys, a, b, "--force")
    assert p.returncode == 0 and p.stdout.startswith("MATCH")
    assert "FORCED: the validation scopes differ (torch_threads)" in p.stdout
    assert "FORCED" not in bitdet_inproc(capsys, a, write_run(tmp_path / "c"), "--force").stdout


def test_shorter_run_is_incomplete_not_a_match(tmp_path, capsys):
    """Run B stopped early: its steps agree with A's, but A's last steps were never compared."""
    a, b = write_run(tmp_path / "a", steps=3), write_run(tmp_path / "b", steps=1)
    r = compare_runs(a, b)
    assert (r.verdict, r.exit_code, r.steps_compared, r.steps_only_in_a, r.steps_only_in_b) == (
        "incomplete", 1, 1, [2, 3], [])
    p = bitdet_inproc(capsys, a, b)
    assert p.returncode == 1 and "INCOMPLETE" in p.stdout and "MATCH" not in p.stdout
    assert compare_runs(a, b, steps=[1]).verdict == "match"  # asked for step 1 only: compared in full
    assert bitdet_inproc(capsys, a, b, "--steps", "1-2").returncode == 1  # step 2 is missing in B


def test_no_step_in_common_is_unusable(tmp_path, capsys):
    def shift(step, rank, line):
        line["step"] = step + 10

    a, b = write_run(tmp_path / "a", steps=3), write_run(tmp_path / "b", steps=3, edit=shift)
    with pytest.raises(BitdetInputError, match="no step in common"):
        compare_runs(a, b)
    p = bitdet_inproc(capsys, a, b)
    assert p.returncode == 2 and "no step in common" in p.stderr and "MATCH" not in p.stdout


def test_metrics_filter(tmp_path):
    def flip(step, rank, line):
        if step == 2:
            line["metrics"]["aux_loss"] = flip_low_bit(line["metrics"]["aux_loss"])

    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b", edit=flip)
    assert compare_runs(a, b, metrics=["loss", "digest:params"]).verdict == "match"
    assert compare_runs(a, b, metrics=["aux_loss"]).first_divergence.ranks == [0, 1]
    with pytest.raises(BitdetInputError, match="no metric named 'mtp_loss'"):
        compare_runs(a, b, metrics=["mtp_loss"])


def write_tensorboard(root: Path, *, steps: int = 6, bump: tuple[str, int] | None = None) -> Path:
    """Scalars logged the way Megatron does (writer.add_scalar), into real event files."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(root))
    for step, fp in enumerate(trajectory(steps, seed=0), start=1):
        for tag, key in (("lm loss", "lm_loss"), ("grad-norm", "grad_norm"), ("learning-rate", "lr")):
            value = _decode32(fp["metrics"][key])
            if bump == (tag, step):
                value = torch.nextafter(value, torch.tensor(float("inf")))
            writer.add_scalar(tag, value.item(), step)
            writer.add_scalar(tag + " vs samples", value.item(), step * 32)
        writer.add_scalar("iteration-time", 0.1 + 0.01 * step * (bump is not None), step)
    writer.close()
    return root


def _decode32(encoded: str) -> torch.Tensor:
    from megatron_bitdet.fingerprint.floatbits import decode_float

    return torch.tensor(decode_float(encoded), dtype=torch.float32)


def test_tensorboard_dirs(tmp_path, capsys):
    a = write_tensorboard(tmp_path / "a")
    same = write_tensorboard(tmp_path / "same")
    p = bitdet_inproc(capsys, a, same)
    assert p.returncode == 0, p.stderr
    assert "MATCH: 6 steps x 1 ranks x 3 metrics" in p.stdout  # timers and "vs samples" left out
    assert "scope was not checked" in p.stderr
    bumped = write_tensorboard(tmp_path / "bumped", bump=("lm loss", 4))
    p = bitdet(a, bumped, "--json")
    assert p.returncode == 1, p.stderr
    div = json.loads(p.stdout)["first_divergence"]
    assert (div["step"], div["metrics"]) == (4, ["lm loss"])
    assert (div["details"][0]["ulp"], div["details"][0]["a"].split(":")[0]) == (1, "float32")
    assert compare_runs(a, same, metrics=["iteration-time"]).verdict == "match"  # hidden tags on request
    assert compare_runs(a, bumped, metrics=["iteration-time"]).first_divergence.step == 1


def test_tensorboard_missing_last_steps_or_cut_record_is_not_a_match(tmp_path, capsys):
    a = write_tensorboard(tmp_path / "a", steps=6)
    short = write_tensorboard(tmp_path / "short", steps=4)  # a run killed after step 4
    p = bitdet_inproc(capsys, a, short)
    assert p.returncode == 1 and "INCOMPLETE" in p.stdout and "only in A: 5-6" in p.stdout
    cut = write_tensorboard(tmp_path / "cut", steps=6)
    (event_file,) = cut.glob("events.out.tfevents.*")
    event_file.write_bytes(event_file.read_bytes()[:-7])  # killed in the middle of the last record
    p = bitdet_inproc(capsys, a, cut)
    assert p.returncode == 2 and f"{event_file}: truncated record" in p.stderr
    assert bitdet_inproc(capsys, a, cut, "--allow-truncated").returncode == 1
    bad = write_tensorboard(tmp_path / "bad", steps=6)
    (event_file,) = bad.glob("events.out.tfevents.*")
    data = bytearray(event_file.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of a record in the middle: TensorBoard's reader stops there silently
    event_file.write_bytes(bytes(data))
    for extra in ((), ("--allow-truncated",)):
        p = bitdet_inproc(capsys, a, bad, *extra)
        assert p.returncode == 2 and f"{event_file}: corrupt record at byte" in p.stderr, p.stderr


def test_missing_or_corrupt_manifest(tmp_path):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b")
    (b / "manifest.json").unlink()
    with pytest.raises(ScopeMismatchError, match="manifest.json: A='present'  B='missing'"):
        compare_runs(a, b)
    assert compare_runs(a, b, force=True).verdict == "match"
    (b / "manifest.json").write_text('{"scope": ')
    with pytest.raises(BitdetInputError, match="malformed manifest"):
        compare_runs(a, b, force=True)
