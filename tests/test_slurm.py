"""Workflows under a real Slurm cluster (slurm_cluster: munged, slurmctld and slurmd started by the tests):
the sbatch script docs/megatron-lm.md gives, submitted as written, proves the README's Megatron-LM line
with each launch an srun job step; verify-resume then runs the resume chain against that run A through
``srun --export=NONE`` (the canonical environment reaches the ranks on their command line, not through
what srun hands on)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)
from test_megatron_lm import MAMBA, MEGATRON_LM

pytestmark = [pytest.mark.megatron_lm, pytest.mark.timeout(1800)]
RANKS = (0, 1)


def docs_sbatch_script() -> str:
    """The batch script in docs/megatron-lm.md, as written."""
    text = (REPO / "docs" / "megatron-lm.md").read_text()
    scripts = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if b.startswith("#!/bin/bash\n#SBATCH")]
    assert len(scripts) == 1, scripts
    return scripts[0]


def job_steps(cluster, job: str) -> list[str]:
    """The steps of ``job`` whose tasks slurmd launched (its log, in order)."""
    return re.findall(rf"launch task StepId={job}\.(\d+) request", (cluster.dir / "slurmd.log").read_text())


@pytest.fixture(scope="module")
def proved(slurm_cluster, tmp_path_factory):  # noqa: F811
    """The docs' script submitted with ``sbatch --wait`` from a fresh folder, the README's launch line as its
    arguments: (job id, sbatch's exit code, the job's output, its prove folder, wall seconds)."""
    import time

    assert MEGATRON_LM, "MEGATRON_LM_PATH"
    here = tmp_path_factory.mktemp("sbatch")
    (here / "prove.sbatch").write_text(docs_sbatch_script())
    env = {**os.environ, **slurm_cluster.env, "MEGATRON_LM_PATH": MEGATRON_LM,
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    began = time.monotonic()
    done = subprocess.run(["sbatch", "--parsable", "--wait", "prove.sbatch", *MAMBA], cwd=here, env=env,
                          capture_output=True, text=True)
    wall = time.monotonic() - began
    job = done.stdout.strip().split(";")[0]
    output = here / f"bitdet-prove-{job}.out"
    text = output.read_text() if output.is_file() else f"(no {output.name}) {done.stdout}{done.stderr}"
    return job, done.returncode, text, here / "runs" / f"prove_{job}", wall


def test_the_docs_sbatch_script_proves_the_readme_line_with_each_launch_an_srun_step(proved, slurm_cluster):  # noqa: F811
    job, rc, out, prove_dir, wall = proved
    print(f"sbatch prove job wall {wall:.1f} s; cluster start {slurm_cluster.start_s:.1f} s")
    assert rc == 0, out[-6000:] + slurm_cluster.logs()
    assert "bitdet prove: verdicts" in out and "every guarantee holds" in out, out[-4000:]
    runs = ("run_a", "run_b", "resume/segment_00_0000000-0000002", "resume/segment_01_0000002-0000003")
    for run in runs:
        assert json.loads((prove_dir / run / "manifest.json").read_text())["scope"]["world_size"] == 2
        for rank in RANKS:  # each srun task teed its own console output into the run directory
            assert (prove_dir / run / "logs" / f"rank_{rank:05d}.log").stat().st_size > 0, (run, rank)
        assert " iteration " in (prove_dir / run / "logs" / "rank_00001.log").read_text(), run
    for rank in RANKS:
        a = (prove_dir / "run_a" / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes()
        assert a and a == (prove_dir / "run_b" / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes()
    # Each launch was one job step of this batch job, two tasks each (slurmctld's own record).
    assert len(job_steps(slurm_cluster, job)) == len(runs), slurm_cluster.logs()


def test_verify_resume_through_srun_export_none_holds_against_the_proved_run_a(proved, slurm_cluster, tmp_path,  # noqa: F811
                                                                               capsys):
    """srun --export=NONE hands the ranks no environment of ours (no PATH even): the canonical one and the
    rendezvous reach them on their command line, and the chain 0 -> 2 -> 3 is bitwise against run A."""
    from megatron_bitdet.cli import main as bitdet

    job, rc, out, prove_dir, _ = proved
    assert rc == 0, out[-3000:]
    out_dir = tmp_path / "vr"
    capsys.readouterr()
    rc = bitdet(["verify-resume", "--megatron-lm", f"{MEGATRON_LM}/pretrain_mamba.py", "--resume-at", "2",
                 "--reference", str(prove_dir / "run_a"), "--out", str(out_dir),
                 "--launcher", "srun --nodes 1 --ntasks-per-node 2 --export=NONE", "--", *MAMBA])
    text = capsys.readouterr().out
    assert rc == 0, text[-4000:]
    assert "HOLDS: resumed at 2" in text, text[-3000:]
    for segment in ("segment_00_0000000-0000002", "segment_01_0000002-0000003"):
        manifest = json.loads((out_dir / segment / "manifest.json").read_text())
        # in the rank's environment from its start (no "in_effect": false), as the launching process set it
        assert manifest["env"]["PYTHONHASHSEED"] == {"source": "launcher", "value": "0"}, manifest["env"]
        assert (out_dir / segment / "logs" / "rank_00001.log").stat().st_size > 0
