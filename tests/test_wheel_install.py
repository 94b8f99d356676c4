"""The distribution as a user gets it, with the README's commands as written: in a fresh virtualenv
(no system site-packages, so a missing dependency fails here; pip's cache makes repeats cheap) the
"Installing into an existing Megatron environment" block runs from a copy of the tree — torch==2.13.0
first, the wheel built and installed with its dependencies from the package index, then
`bitdet recipe validate nemotron_h_tiny` from another directory; the wheel's metadata declares the
megatron-core range and, on Python 3.11, pip took 0.16.1 for it by itself. There, the README's guard file runs
under pytest: the plugin is found through its entry point (no conftest, no source tree), its kernel
and module checks pass, and its end-to-end check runs two 2-rank 3-step `bitdet train` runs and
`bitdet compare`; `bitdet compare` of those runs is then run by hand too."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INSTALLED_CHECK = """
import sysconfig
from importlib.metadata import requires, version
from packaging.requirements import Requirement
import megatron_bitdet
from megatron_bitdet import resources
from megatron_bitdet.compat.versions import MEGATRON_CORE
assert version("megatron-bitdet") == megatron_bitdet.__version__
pins = [Requirement(r) for r in requires("megatron-bitdet") if Requirement(r).name == "megatron-core"]
assert [p.specifier for p in pins] == [MEGATRON_CORE], pins  # the metadata says what the code enforces
import sys
if sys.version_info < (3, 12):  # pip's own pick for the range: every 0.17+ wheel is cp312
    assert version("megatron-core") == "0.16.1", version("megatron-core")
from megatron_bitdet.trace import native
assert native.SOURCE.is_file()  # the native op tracer's source ships (it is built on first use)
print(sysconfig.get_paths()["purelib"], megatron_bitdet.__file__, resources.shipped_dir("patches"),
      native.SOURCE)
"""


def readme_block(heading: str, lang: str) -> str:
    """The first ``lang`` code block under a README heading."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(f"\n## {heading}\n"):]
    return re.search(rf"```{lang}\n(.*?)```", section, re.S).group(1)


def _run(argv, cwd, env, timeout=900):
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (f"{' '.join(map(str, argv))} -> exit {done.returncode}\n"
                                  f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done.stdout


def _source_copy(dest: Path) -> Path:
    """The files a clone has (tracked + new, not ignored): no build outputs, no dev venv."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    return dest


@pytest.mark.timeout(1800)
def test_readme_install_block_and_guard_file_in_a_fresh_venv(tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to know which files a clone has")
    with tempfile.TemporaryDirectory(prefix="bitdet_wheel_") as scratch:  # the venv (~1 GB) goes afterwards
        scratch = Path(scratch)
        src, venv, work = _source_copy(scratch / "src"), scratch / "venv", tmp_path / "work"
        work.mkdir()
        # pip installs without byte-compiling every file it unpacks (torch's thousands): the
        # interpreter compiles what it imports, once, when it first imports it -- so bytecode writing
        # stays on here even where the machine turns it off (PYTHONDONTWRITEBYTECODE=1 made every
        # process of this venv recompile torch and megatron-core from source: +15 s each).
        _run([sys.executable, "-m", "venv", venv], cwd=scratch, env={**os.environ, "PIP_NO_COMPILE": "1"})
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")}
        env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), PIP_NO_COMPILE="1")
        python = venv / "bin" / "python"

        out = _run(["bash", "-euo", "pipefail", "-c", readme_block("Installing into an existing Megatron environment",
                                                                   "bash")], cwd=src, env=env)
        assert "OK nemotron_h_tiny:" in out and re.search(r"\d+ rules clear", out), out
        where = _run([python, "-c", INSTALLED_CHECK], cwd=work, env=env).split()
        assert all(p.startswith(where[0]) for p in where[1:]), where  # the wheel's files, not the checkout's

        _run([python, "-m", "pip", "install", "-q", "pytest"], cwd=work, env=env)
        (work / "test_guards.py").write_text(readme_block("Guarding your own kernels", "python"))
        out = _run([python, "-m", "pytest", "-p", "no:cacheprovider", "--basetemp", work / "pt", "test_guards.py"],
                   cwd=work, env=env)
        assert "bitdet: megatron-bitdet" in out and "3 passed" in out, out  # the plugin's header: discovered
        (runs,) = [p for p in (work / "pt").glob("*/bitdet_e2e_check") if not p.parent.is_symlink()]
        out = _run(["bitdet", "compare", runs / "a", runs / "b"], cwd=work, env=env)
        assert out.startswith("MATCH: 3 steps x 2 ranks"), out
