"""``bitdet check`` on real gloo runs of the tiny hybrid without the distributed optimizer (every
buffer and Adam's moments replicated): one bit flipped in one replica's copy of bytes that replica
does not own, in the params and in ``exp_avg``, is named with that replica (the majority's odd one out
at DP >= 3, both at DP 2) at the last step of the bound (D x K steps); a clean run is consistent and
says what it covered; a missing, emptied or cut rank file gives no verdict."""
from __future__ import annotations

import json
import shutil

import pytest

from megatron_bitdet.cli import main as bitdet
from megatron_bitdet.fingerprint.shards import CHECK_CHUNKS
from conftest import RECIPE
from test_step_digests import run, test_workers  # noqa: F401  (a fixture)

REPLICATED = ("parallel.expert=1", "parallel.distributed_optimizer=false")
FLIP_STEP = 2
RANKS = {2: (1, 1), 4: (2, 3), 8: (2, 5)}  # DP -> (rank whose params flip, rank whose exp_avg flips)


@pytest.fixture(scope="module")
def clean_dp4(tmp_path_factory):
    """One clean DP 4 run (5 steps) shared by the consistency and missing-evidence tests."""
    path = tmp_path_factory.mktemp("clean") / "run"
    assert run(path, *REPLICATED, nproc=4, iterations=5) == 0
    return path


def check_json(path, capsys, *extra) -> tuple[int, dict]:
    capsys.readouterr()
    rc = bitdet(["check", "--json", *extra, str(path)])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("dp", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_a_flip_in_bytes_a_replica_does_not_own_is_named_within_the_bound(tmp_path, test_workers, capsys, dp):
    """The flips land (as step 2 begins) in the chunks checked just before it, so the check first sees
    them at the bound's last steps: params at step 2 + D*K - 1, exp_avg one step earlier."""
    bound = dp * CHECK_CHUNKS
    p_rank, m_rank = RANKS[dp]
    flips = [["params", p_rank, (FLIP_STEP - 1) % bound], ["exp_avg", m_rank, (FLIP_STEP - 2) % bound]]
    where = tmp_path / "flips.json"
    batch = ["training.micro_batch_size=1"] if dp == 8 else []  # the recipe's global batch is 8
    assert run(tmp_path / "run", *REPLICATED, *batch, nproc=dp, iterations=FLIP_STEP + bound - 1,
               worker="fingerprint_workers:replica_flips",
               worker_args={"plant": {"step": FLIP_STEP, "flips": flips, "out": str(where)}}) == 0
    planted = json.loads(where.read_text())
    rc, report = check_json(tmp_path / "run", capsys)
    assert rc == 1 and report["verdict"] == "disagree"
    for flip in planted:
        assert flip["seen_at"] <= FLIP_STEP + bound - 1
        named = [d for d in report["disagreements"] if d["kind"] == flip["kind"] and d["buf"] == flip["buf"]
                 and d["first_byte"] <= flip["byte"] < d["end_byte"]]
        assert named, (flip, report["disagreements"])
        first = named[0]
        assert first["step"] == flip["seen_at"]  # never before: the chunk was not compared in between
        assert first["suspects"] == ([flip["rank"]] if dp > 2 else [0, 1])
        assert first["majority"] == (dp > 2) and len(first["digests"]) == dp
    # every disagreement comes after the flips and names only the flipped replicas
    assert all(d["step"] >= FLIP_STEP for d in report["disagreements"])
    assert set(report["suspects"]) == ({p_rank, m_rank} if dp > 2 else {0, 1})
    capsys.readouterr()
    assert bitdet(["check", str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out
    if dp > 2:
        assert f"rank(s) {p_rank} differ from the majority ({dp - 1} of {dp} replicas" in out
    else:
        assert "ranks 0, 1 disagree with no majority: every one a suspect" in out


@pytest.mark.timeout(600)
def test_a_clean_run_is_consistent_and_says_what_it_covered(clean_dp4, capsys):
    rc, report = check_json(clean_dp4, capsys)
    assert rc == 0 and report["verdict"] == "consistent" and not report["disagreements"]
    kinds = {c["kind"] for c in report["coverage"]}
    assert {"params", "grads", "exp_avg", "exp_avg_sq"} <= kinds
    # 5 steps of a 16-step cycle: 5 of each region's 16 chunks compared across all 4 replicas
    for c in report["coverage"]:
        assert c["replicas"] == 4 and c["steps"] == [1, 2, 3, 4, 5] and not c["complete"]
        assert c["copies"] == 4 * 16 and c["copies_compared"] == 4 * 5
    capsys.readouterr()
    assert bitdet(["check", str(clean_dp4)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CONSISTENT: ") and "exp_avg 0.dense.0: " in out and "20 of 64 replica-chunks" in out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("damage,rc,says", [
    ("missing", 2, "rank(s) [2] have no fingerprint file"),
    ("empty", 2, "empty fingerprint file"),
    ("cut_line", 2, "truncated final line"),
    ("last_line", 1, "rank 2 has no line for step(s) 5"),
])
def test_check_gives_no_verdict_without_every_ranks_evidence(clean_dp4, tmp_path, capsys, damage, rc, says):
    """A copy of the clean run with rank 2's file removed, emptied, cut mid-line or short of its last
    line: exit 2 for the first three, INCOMPLETE (exit 1) for the last; cut mid-line with
    --allow-truncated is INCOMPLETE too, never CONSISTENT."""
    copy = tmp_path / "run"
    shutil.copytree(clean_dp4, copy)
    f = copy / "fingerprints" / "rank_00002.jsonl"
    data = f.read_bytes()
    if damage == "missing":
        f.unlink()
    elif damage == "empty":
        f.write_bytes(b"")
    elif damage == "cut_line":
        f.write_bytes(data[:-20])
    else:
        f.write_bytes(data[:data.rstrip(b"\n").rfind(b"\n") + 1])
    capsys.readouterr()
    assert bitdet(["check", str(copy)]) == rc
    captured = capsys.readouterr()
    assert says in captured.out + captured.err
    if damage == "cut_line":
        got, report = check_json(copy, capsys, "--allow-truncated")
        assert got == 1 and report["verdict"] == "incomplete"


def _damage(copy, damage: str) -> tuple[str, str]:
    """Rank 2's fingerprint file of a run copy removed, emptied or cut mid-line; what the refusal names."""
    f = copy / "fingerprints" / "rank_00002.jsonl"
    if damage == "missing":
        f.unlink()
        return "rank_00002.jsonl", "missing"
    if damage == "empty":
        f.write_bytes(b"")
        return "rank_00002.jsonl", "empty fingerprint file"
    f.write_bytes(f.read_bytes()[:-20])
    return "rank_00002.jsonl:5", "truncated final line"


def _verdict_argv(command: str, clean, copy, tmp_path) -> list[str]:
    """Each verdict command on the damaged copy (as run B where it takes two runs); what it would
    launch comes only after its input is judged, so none launches here."""
    recipe = ["--recipe", str(RECIPE), "--nproc", "4", *REPLICATED, "training.iterations=5"]
    if command == "fixcheck":  # the damaged copy is a reused original run
        for i, src in enumerate((clean, copy)):
            shutil.copytree(src, tmp_path / "fc" / "original" / f"run_{i}")
        return ["fixcheck", *recipe, "--out", str(tmp_path / "fc"), "--reuse-original", "--fix", "training.seed=7",
                "--no-localize", "--no-tax"]
    return {"compare": ["compare", str(clean), str(copy)],
            "check": ["check", str(copy)],
            "verify-resume": ["verify-resume", *recipe, "--resume-at", "2", "--reference", str(copy),
                              "--out", str(tmp_path / "vr")],
            "localize": ["localize", str(clean), str(copy)],
            "doctor": ["doctor", str(clean), str(copy), "--offline"],
            "replay": ["replay", str(copy), "--step", "3"]}[command]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", ["missing", "empty", "truncated"])
@pytest.mark.parametrize("command", ["compare", "check", "verify-resume", "localize", "fixcheck", "replay", "doctor"])
def test_every_verdict_command_refuses_a_run_with_a_rank_file_missing_empty_or_cut(clean_dp4, tmp_path, capsys,
                                                                                   command, damage):
    """One shared real DP 4 run, copied and damaged per case: exit 2 naming the file, never a verdict."""
    copy = tmp_path / "run"
    shutil.copytree(clean_dp4, copy)
    says = _damage(copy, damage)
    argv = _verdict_argv(command, clean_dp4, copy, tmp_path)
    capsys.readouterr()
    assert bitdet(argv) == 2
    captured = capsys.readouterr()
    assert all(s in captured.out + captured.err for s in says), (captured.out[-2000:], captured.err[-2000:])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command,rc", [("compare", 1), ("check", 1), ("localize", 2), ("doctor", 1)])
def test_a_rank_file_that_stops_early_is_incomplete_never_a_pass(clean_dp4, tmp_path, capsys, command, rc):
    """Rank 2's last line gone, whole lines left (a rank that stopped early): INCOMPLETE (exit 1), or
    for localize nothing to localize (exit 2); never a match."""
    copy = tmp_path / "run"
    shutil.copytree(clean_dp4, copy)
    f = copy / "fingerprints" / "rank_00002.jsonl"
    data = f.read_bytes()
    f.write_bytes(data[:data.rstrip(b"\n").rfind(b"\n") + 1])
    argv = _verdict_argv(command, clean_dp4, copy, tmp_path)
    capsys.readouterr()
    assert bitdet(argv) == rc
    captured = capsys.readouterr()
    text = (captured.out + captured.err).lower()
    assert "incomplete" in text or "stopped early" in text, text[-2000:]
