"""What a test run says about what it skipped: the Megatron-LM marker's skip reason, the closing count
line, BITDET_REQUIRE_MEGATRON_LM=1 turning such a skip into a failure (as .ci/run sets it), and .ci/run
refusing a MEGATRON_LM_PATH with no checkout before it runs anything; the Slurm cluster fixture skipping
without Slurm, naming why, and failing instead under BITDET_REQUIRE_SLURM=1 (.ci/run). Each runs the real
conftest, fixture module (or script) in its own process on a small test file. And the megatron-core leg: the
closing line naming the megatron-core version and the counts, ``--megatron-core-leg`` leaving out exactly the files
conftest's one list names, and .ci/run refusing a missing 0.19 checkout."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = '''
import pytest

@pytest.mark.megatron_lm
def test_drives_megatron_lm():
    pass

def test_plain():
    pass
'''


def _pytest(tmp_path, *args, **env):
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_x.py").write_text(TESTS)
    clean = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM_PATH", "BITDET_REQUIRE_MEGATRON_LM")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "test_x.py", *args],
                          cwd=tmp_path, env={**clean, **env}, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout.strip().splitlines()


def _megatron_core() -> str:
    from importlib.metadata import version
    from platform import python_version

    return f"megatron-core {version('megatron-core')} (Python {python_version()}): "


def test_without_a_checkout_the_megatron_lm_test_skips_naming_why_and_the_count_says_so(tmp_path):
    rc, lines = _pytest(tmp_path, MEGATRON_LM_PATH=str(tmp_path / "nowhere"))
    assert rc == 0, lines
    assert any(line.startswith("SKIPPED [1]") and "holds no pretrain_mamba.py" in line for line in lines), lines
    assert lines[-2].startswith("Megatron-LM tests: 0 ran (0 failed), 1 skipped: MEGATRON_LM_PATH="), lines
    assert lines[-1].startswith("1 passed, 1 skipped"), lines


def test_required_megatron_lm_turns_the_skip_into_a_failure(tmp_path):
    rc, lines = _pytest(tmp_path, BITDET_REQUIRE_MEGATRON_LM="1")
    assert rc == 1, lines
    assert any("BITDET_REQUIRE_MEGATRON_LM=1 but this Megatron-LM test skipped" in line for line in lines), lines
    assert lines[-2].startswith("Megatron-LM tests: 0 ran (0 failed), 1 skipped (1 counted as failures"), lines
    assert lines[-1].startswith("1 passed, 1 error"), lines


def test_with_a_checkout_the_count_says_it_ran(tmp_path):
    fake = tmp_path / "megatron-lm"
    fake.mkdir()
    (fake / "pretrain_mamba.py").write_text("")
    rc, lines = _pytest(tmp_path, MEGATRON_LM_PATH=str(fake), BITDET_REQUIRE_MEGATRON_LM="1")
    assert rc == 0, lines
    assert lines[-2] == "Megatron-LM tests: 1 ran (0 failed), 0 skipped", lines


def test_ci_refuses_a_missing_megatron_lm_checkout_before_running_anything(tmp_path):
    done = subprocess.run(["bash", str(REPO / ".ci" / "run")], env={**os.environ, "MEGATRON_LM_PATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"MEGATRON_LM_PATH={tmp_path} holds no Megatron-LM checkout" in done.stderr
    assert not done.stdout  # make test never started


def test_ci_refuses_a_missing_megatron_lm_0_19_checkout_before_running_anything(tmp_path):
    """The 0.19 leg's entry points are checked with the default leg's, before either leg starts."""
    fake = tmp_path / "megatron-lm"
    fake.mkdir()
    (fake / "pretrain_mamba.py").write_text("")
    done = subprocess.run(["bash", str(REPO / ".ci" / "run")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MEGATRON_LM_PATH": str(fake), "MEGATRON_LM_019_PATH": str(fake)})
    assert done.returncode == 1
    assert f"MEGATRON_LM_019_PATH={fake} holds no Megatron-LM core_v0.19.0 entry points (no pretrain_hybrid.py)" \
        in done.stderr, done.stderr
    assert not done.stdout


def test_the_run_closes_with_the_megatron_core_version_and_its_counts(tmp_path):
    rc, lines = _pytest(tmp_path)
    assert rc == 0, lines
    assert lines[-3] == _megatron_core() + "1 passed, 0 failed, 0 error, 1 skipped, 0 deselected", lines


def test_the_megatron_core_leg_leaves_out_exactly_the_listed_files(tmp_path):
    """A file conftest lists as megatron-core-free is deselected, one it does not list runs, and the closing line
    says how many were left out; without the option both run."""
    from conftest import MEGATRON_CORE_FREE

    listed = sorted(MEGATRON_CORE_FREE)[0]
    (tmp_path / listed).write_text("def test_free():\n    pass\n")
    rc, lines = _pytest(tmp_path, listed, "--megatron-core-leg")
    assert rc == 0, lines
    assert lines[-3] == _megatron_core() + "1 passed, 0 failed, 0 error, 1 skipped, 1 deselected " \
        f"(--megatron-core-leg: {len(MEGATRON_CORE_FREE)} megatron-core-free files left out)", lines
    rc, lines = _pytest(tmp_path, listed)
    assert rc == 0 and lines[-3] == _megatron_core() + "2 passed, 0 failed, 0 error, 1 skipped, 0 deselected", lines


def test_every_file_the_megatron_core_leg_leaves_out_is_a_test_file_here():
    from conftest import MEGATRON_CORE_FREE

    assert set(MEGATRON_CORE_FREE) <= {p.name for p in (REPO / "tests").glob("test_*.py")}


SLURM_TEST = '''
from slurm_cluster import slurm_cluster  # noqa: F401

def test_needs_slurm(slurm_cluster):
    pass
'''


def test_without_slurm_the_slurm_tests_skip_naming_why_and_required_slurm_fails_them(tmp_path):
    """PATH holding only this interpreter's folder: no munged, slurmctld, srun ... to start a cluster with."""
    shutil.copy(REPO / "tests" / "slurm_cluster.py", tmp_path / "slurm_cluster.py")
    (tmp_path / "test_s.py").write_text(SLURM_TEST)
    clean = {k: v for k, v in os.environ.items() if k != "BITDET_REQUIRE_SLURM"}
    clean["PATH"] = str(Path(sys.executable).parent)
    runs = [subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "test_s.py"],
                           cwd=tmp_path, env={**clean, **env}, capture_output=True, text=True, timeout=300)
            for env in ({}, {"BITDET_REQUIRE_SLURM": "1"})]
    skipped, required = (r.stdout.strip().splitlines() for r in runs)
    assert runs[0].returncode == 0, skipped
    assert any(line.startswith("SKIPPED [1]") and "Slurm / munge not installed (munged, mungekey, slurmctld" in line
               for line in skipped), skipped
    assert runs[1].returncode == 1, required
    assert any("BITDET_REQUIRE_SLURM=1 but the Slurm tests cannot run: Slurm / munge not installed" in line
               for line in required), required
    assert required[-1].startswith("1 error"), required
