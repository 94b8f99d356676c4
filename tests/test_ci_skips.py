"""What a test run says about what it skipped: the Megatron-LM marker's skip reason, the closing count
line, BITDET_REQUIRE_MEGATRON_LM=1 turning such a skip into a failure (as .ci/run sets it), and .ci/run
refusing a MEGATRON_LM_PATH with no checkout before it runs anything. Each runs the real conftest (or
script) in its own process on a two-test file."""
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


def _pytest(tmp_path, **env):
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_x.py").write_text(TESTS)
    clean = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM_PATH", "BITDET_REQUIRE_MEGATRON_LM")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "test_x.py"],
                          cwd=tmp_path, env={**clean, **env}, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout.strip().splitlines()


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
