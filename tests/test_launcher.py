"""Workflows through a cluster launch template (``--launcher``): bad templates refused before any rank
starts; one-rank torchrun launches on this machine whose rank does not share the run directory (refused,
naming its host; the missing log named) or starts without the launch's environment (refused, naming each
variable); and real launches across two "nodes" (network namespaces joined by a veth pair, torchrun's c10d
rendezvous; conftest.two_nodes): a trivial worker (every rank's log collected into the run directory) and
`bitdet prove --megatron-lm` printing its verdict table. Slurm: tests/test_slurm.py.
"""
from __future__ import annotations

import json
import os
import random
import re
import socket
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


def templates(nodes, nproc_per_node: int) -> list[str]:
    """One torchrun template per node, each led by what runs it on its namespace."""
    import shlex

    port = random.randrange(29500, 29900)
    return [shlex.join([*nodes.prefix(i), TORCHRUN, "--nnodes", "2", "--nproc-per-node",
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


def _allreduce(run_dir: Path, out: Path, launcher, nproc: int = 2) -> int:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    with through(launcher):
        return launch("dist_workers:allreduce", nproc, {"out": str(out)}, run_dir=run_dir, env=env)


@pytest.mark.slow  # the prove test below covers every rank's log in the default run
@pytest.mark.timeout(300)
def test_two_nodes_collect_every_ranks_log(two_nodes, tmp_path):
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


def _one_rank(run_dir: Path, out: Path, lead=(), torchrun: str = TORCHRUN, **env) -> int:
    """One rank through a torchrun template on this machine, led by ``lead`` (what runs torchrun); its
    worker (cheap: no collective) writes ``out/worker.json``."""
    import shlex

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])), **env}
    with through(parse_launcher([shlex.join([*lead, torchrun, "--standalone", "--nproc-per-node", "1"])])):
        return launch("dist_workers:hash_state", 1, {"out": str(out)}, run_dir=run_dir, env=env)


def _private(run_dir: Path, then: str = "true") -> list[str]:
    """A prefix that gives torchrun and its rank their own (empty) folder at ``run_dir``, then runs ``then``:
    a node that does not share the run directory."""
    return ["unshare", "--mount", "sh", "-c", f'mount -t tmpfs none "{run_dir}" && {then} && exec "$@"', "private"]


@pytest.mark.timeout(300)
def test_a_rank_that_does_not_see_the_run_directory_refuses_and_a_missing_log_is_named(tmp_path, capfd):
    """A node without the run directory: its rank refuses at start naming its host and the folder, and the
    launch says whose log is missing. A node with its own folder at that path (the rank runs, exit 0, its
    log lands there): the launch fails naming the file that is not here."""
    from conftest import netns_available

    if netns_available():  # root, unshare and mount: the same needs as the two-node tests
        pytest.skip(netns_available())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = run_dir / "logs" / "rank_00000.log"
    assert _one_rank(run_dir, tmp_path, _private(run_dir)) != 0
    err = "".join(capfd.readouterr())
    assert f"rank 0: error: on host {socket.gethostname()}: refused: {run_dir / 'logs'} does not exist here" in err, err
    assert f"no log from rank(s) [0] ({log}): they did not start, or refused before writing one" in err, err
    assert not (tmp_path / "worker.json").exists()  # the worker never ran
    with pytest.raises(BitdetError, match=rf"rank\(s\) \[0\] exited 0 but {re.escape(str(log))} is not here"):
        _one_rank(run_dir, tmp_path, _private(run_dir, f'mkdir "{run_dir}/logs"'))
    assert (tmp_path / "worker.json").exists()


@pytest.mark.timeout(300)
def test_a_rank_started_without_the_launchs_environment_is_refused_naming_each_variable(tmp_path, capfd):
    """A site's torchrun wrapper that drops PYTHONHASHSEED and sets another NCCL_ALGO: bitdet's explicit
    ``env K=V`` comes before it, so the rank starts without what the launch validated, and refuses (exit 2)
    before its worker runs, naming both."""
    wrapper = tmp_path / "site" / "torchrun"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec env -u PYTHONHASHSEED NCCL_ALGO=Tree "{TORCHRUN}" "$@"\n')
    wrapper.chmod(0o755)
    rc = _one_rank(tmp_path / "run", tmp_path, torchrun=str(wrapper), PYTHONHASHSEED="0", NCCL_ALGO="Ring")
    err = "".join(capfd.readouterr())  # a launcher's rank tees stderr with stdout
    assert rc != 0, err
    refusal = next((line for line in err.splitlines() if "did not start with the environment" in line), err)
    assert refusal.startswith(f"rank 0: error: on host {socket.gethostname()}: refused:"), refusal
    assert "PYTHONHASHSEED='0' missing" in refusal and "NCCL_ALGO='Ring' but 'Tree' here" in refusal, refusal
    assert refusal in (tmp_path / "run" / "logs" / "rank_00000.log").read_text()  # teed before refusing
    assert not (tmp_path / "worker.json").exists()  # the worker never ran


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
