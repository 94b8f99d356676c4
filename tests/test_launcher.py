"""Workflows through a cluster launch template (``--launcher``): bad templates refused before any rank
starts, and real launches across two "nodes" (network namespaces joined by a veth pair, torchrun's c10d
rendezvous; conftest.two_nodes): a trivial worker (every rank's log collected into the run directory,
and a launch whose run directory a node does not share refused), and `bitdet prove --megatron-lm`
printing its verdict table.
"""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

from conftest import RECIPE, megatron_lm_missing
from megatron_bitdet.cli import main as bitdet
from megatron_bitdet.errors import BitdetError
from megatron_bitdet.train.launch import launch, parse_launcher, through

TESTS = str(Path(__file__).parent)
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# The five workflows that take --launcher, each with arguments that get it past argparse.
WORKFLOWS = {"prove": ["--recipe", "nemotron_h_tiny"], "verify-resume": ["--recipe", "nemotron_h_tiny", "--resume-at", "2"],
             "fixcheck": ["--recipe", "nemotron_h_tiny", "--fix", "training.seed=2"],
             "localize": ["a", "b"], "replay": ["a", "--step", "2"]}


def templates(nodes, nproc_per_node: int, *, node1_extra=()) -> list[str]:
    """One torchrun template per node, each led by what runs it on its namespace."""
    import shlex

    port = random.randrange(29500, 29900)
    return [shlex.join([*nodes.prefix(i), *(node1_extra if i else ()), TORCHRUN, "--nnodes", "2", "--nproc-per-node",
                        str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes.master}:{port}"])
            for i in (0, 1)]


@pytest.mark.parametrize("template, extra, named", [
    ("mpirun -n 2", [], "unknown launcher program 'mpirun'"),
    ("torchrun --nnodes 1 --standalone", [], "torchrun needs --nproc-per-node"),
    ("torchrun --standalone --nproc-per-node 4", ["--nproc", "2"], "starts 4 ranks (--nnodes 1 x --nproc-per-node 4) "
                                                                    "but --nproc is 2"),
    ("torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint h:1", [],
     "torchrun --nnodes 2 needs one template per node"),
    ("torchrun --nnodes 1:2 --nproc-per-node 1", [], "--nnodes 1:2: a fixed node count is needed"),
    ("torchrun --standalone --nproc-per-node 2 train.py", [], "end the template with torchrun's options"),
    ("srun --nodes 2", [], "srun needs --ntasks-per-node"),
])
def test_a_bad_template_exits_2_naming_the_flag_before_any_rank_starts(template, extra, named, tmp_path, capsys):
    for command, args in WORKFLOWS.items():
        if extra and command in ("localize", "replay"):  # no --nproc: the run's manifest sets it
            continue
        out = ["--out", str(tmp_path / command)] if command in ("prove", "verify-resume") else []
        assert bitdet([command, *args, *out, *extra, "--launcher", template]) == 2, command
        err = capsys.readouterr().err
        assert "--launcher" in err and named in err, (command, err)
    assert not any(tmp_path.iterdir())  # nothing launched, nothing written


def test_the_recipes_layout_is_checked_against_the_templates_world_size(tmp_path, capsys):
    """--nproc defaults to the template's world size, which the recipe's layout must fit (EP 2 on 3 ranks)."""
    assert bitdet(["prove", "--recipe", str(RECIPE), "--out", str(tmp_path / "p"),
                   "--launcher", "torchrun --standalone --nproc-per-node 3"]) == 2
    assert "--nproc 3 is not divisible by expert" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_a_relaunch_of_another_world_size_is_refused_before_any_rank_starts(tmp_path):
    """The ladder and replay take the world size from the run's manifest: launch() checks it against the
    template (exit 2 naming --launcher), nothing started."""
    from megatron_bitdet.errors import BitdetInputError

    with pytest.raises(BitdetInputError, match=r"--launcher starts 3 ranks .* but this run's world size is 2"):
        _allreduce(tmp_path / "run", tmp_path, parse_launcher(["torchrun --standalone --nproc-per-node 3"]))
    assert not any(tmp_path.iterdir())


def _allreduce(run_dir: Path, out: Path, launcher) -> int:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    with through(launcher):
        return launch("dist_workers:allreduce", 2, {"out": str(out)}, run_dir=run_dir, env=env)


@pytest.mark.slow  # two launches; the prove test below covers every rank's log in the default run
@pytest.mark.timeout(300)
def test_two_nodes_collect_every_ranks_log_and_refuse_a_run_dir_a_node_does_not_share(two_nodes, tmp_path):
    launcher = parse_launcher(templates(two_nodes, 1))
    assert (launcher.nnodes, launcher.nproc_per_node) == (2, 1)
    run_dir = tmp_path / "run"
    assert _allreduce(run_dir, tmp_path, launcher) == 0
    results = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert [r["sum"] for r in results] == [3.0, 3.0]  # a real collective across the veth pair
    assert [r["env"]["RANK"] for r in results] == ["0", "1"]
    assert {r["env"]["WORLD_SIZE"] for r in results} == {"2"}
    for rank in (0, 1):  # each rank tees its own output into the shared run directory
        assert f"rank {rank} sum 3.0" in (run_dir / "logs" / f"rank_{rank:05d}.log").read_text()
    # Node 1 mounts its own (empty) directory over the run directory: its rank's log never reaches it.
    hidden = tmp_path / "not_shared"
    hidden.mkdir()
    private = ["sh", "-c", f'mount -t tmpfs none "{hidden}" && exec "$@"', "private"]
    with pytest.raises(BitdetError, match=r"rank\(s\) \[1\] left no log in .*every node mounts"):
        _allreduce(hidden, tmp_path, parse_launcher(templates(two_nodes, 1, node1_extra=private)))


@pytest.mark.megatron_lm
@pytest.mark.timeout(1800)
def test_prove_megatron_lm_through_a_two_namespace_torchrun_template_prints_the_verdicts(two_nodes, tmp_path, capsys):
    """The README's prove line (its --nproc 2: EP 2), each launch 1 rank on each of two nodes through
    torchrun; run A vs run B, the resume chain, the verdict table. Then one rank's fingerprints taken out
    of run B: the comparison refuses to call it clean."""
    from test_megatron_lm import readme_command

    assert megatron_lm_missing() is None
    argv = readme_command("bitdet prove", tmp_path, "--no-tax", *[a for t in templates(two_nodes, 1)
                                                                  for a in ("--launcher", t)])
    capsys.readouterr()
    rc = bitdet(argv)
    out = capsys.readouterr().out
    assert rc == 0, out[-4000:]
    assert "bitdet prove: verdicts" in out and "every guarantee holds" in out
    # A world of 2 at one rank per node forms only across the veth pair; node 1's rank (Megatron's last,
    # which prints the iterations) tees its log into the run directory beside node 0's.
    for run in ("run_a", "run_b", "resume/segment_00_0000000-0000002", "resume/segment_01_0000002-0000003"):
        assert json.loads((tmp_path / run / "manifest.json").read_text())["scope"]["world_size"] == 2
        assert (tmp_path / run / "logs" / "rank_00000.log").stat().st_size > 0, run
        assert " iteration " in (tmp_path / run / "logs" / "rank_00001.log").read_text(), run
    for rank in (0, 1):
        a = (tmp_path / "run_a" / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes()
        assert a and a == (tmp_path / "run_b" / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes()
    (tmp_path / "run_b" / "fingerprints" / "rank_00001.jsonl").unlink()
    assert bitdet(["compare", str(tmp_path / "run_a"), str(tmp_path / "run_b")]) == 2
    assert "fingerprint file for rank 1 is missing" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verify_resume_of_a_recipe_through_a_two_namespace_torchrun_template(two_nodes, tmp_path, capsys):
    """bitdet's own loop through the same template: the tiny recipe's resume chain across two nodes."""
    out = tmp_path / "vr"
    rc = bitdet(["verify-resume", "--recipe", str(RECIPE), "--resume-at", "2", "--out", str(out), "--json",
                 *[a for t in templates(two_nodes, 1) for a in ("--launcher", t)], "training.iterations=3"])
    text = capsys.readouterr().out
    assert rc == 0, text[-4000:]
    ranks = json.loads((out / "reference" / "manifest.json").read_text())["placement"]["ranks"]
    assert sorted(r["host"] for r in ranks) == ["node0", "node1"]
