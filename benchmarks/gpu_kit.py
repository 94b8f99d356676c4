"""``make gpu-kit``: the wheels ``benchmarks/gpu_check.py`` needs on a bare GPU machine (CPython 3.12,
manylinux x86_64, torch installed, no package index), built here into one ignored folder.

    .venv/bin/python benchmarks/gpu_kit.py [--out gpu-kit]

The kit: megatron-core 0.19.2's cp312 wheel, this plugin's wheel (built from the tree with a build folder
of its own, so a stale ``build/lib`` never ships), and every other dependency the plugin declares with
theirs -- never torch, never a CUDA wheel (the machine's torch brings triton and the CUDA libraries).
Before saying "built" it checks what it promises: at most 64 MiB in all (the size is printed; over it,
exit 1), and pip, with no index and no configured links, resolves ``megatron-bitdet`` and
``megatron-core==0.19.2`` for CPython 3.12 on manylinux x86_64 from the kit alone, torch being the one
requirement met from outside (by a metadata-only ``torch`` wheel in another folder, standing for the
machine's own), and takes every wheel the kit holds: nothing missing, nothing unused. The install line
is in gpu_check.py's docstring.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
MEGATRON_CORE = "megatron-core==0.19.2"
OUTSIDE = {"torch": "2.11.0"}  # on the machine already (the GPU machines' torch); never in the kit
LIMIT_MIB = 64
PYTHON = "3.12"
# pip matches each manylinux tag exactly (no older-glibc expansion): name every one the wheels use
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in (28, 27, 26, 25, 24, 17, 12, 5)] + \
    ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
TARGET = ["--only-binary=:all:", "--python-version", PYTHON, *(a for p in PLATFORMS for a in ("--platform", p))]


def pip(*args: str, env: dict | None = None) -> str:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"pip {' '.join(args[:2])} ... failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def plugin_requirements() -> list[str]:
    """pyproject's dependencies less torch (the machine's) and megatron-core (pinned to 0.19.2 here)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if canonicalize_name(Requirement(d).name) not in {"torch", "megatron-core"}]


def build(kit: Path, scratch: Path) -> None:
    cfg = scratch / "build.cfg"
    cfg.write_text(f"[build]\nbuild_base = {scratch / 'build'}\n")
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(kit), str(ROOT),
        env={**os.environ, "DIST_EXTRA_CONFIG": str(cfg)})
    pip("download", "-q", *TARGET, "--no-deps", "-d", str(kit), MEGATRON_CORE)
    pip("download", "-q", *TARGET, "-d", str(kit), *plugin_requirements())


def stand_in(name: str, version: str, folder: Path) -> None:
    """A wheel with metadata only: lets the resolver see ``name`` as present, installs nothing real."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: gpu_kit\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def resolves_offline(kit: Path, scratch: Path) -> list[str]:
    """The wheels pip's resolver takes for CPython 3.12 from the kit alone (no index, no config, no PIP_*
    links). ``pip download``, not ``pip install --dry-run``: pip 23's install checks Requires-Python
    against the running interpreter, whatever ``--python-version`` says."""
    outside, taken = scratch / "outside", scratch / "taken"
    for name, version in OUTSIDE.items():
        stand_in(name, version, outside)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    pip("download", "-q", "--no-index", "--find-links", str(kit), "--find-links", str(outside), "-d", str(taken),
        *TARGET, "megatron-bitdet", MEGATRON_CORE, env=env)
    return sorted(w.name for w in taken.glob("*.whl"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "gpu-kit"))
    kit = Path(p.parse_args().out).resolve()
    shutil.rmtree(kit, ignore_errors=True)
    kit.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="gpu_kit_") as scratch:
        build(kit, Path(scratch))
        held = sorted(w.name for w in kit.glob("*.whl"))
        mib = sum((kit / w).stat().st_size for w in held) / 2**20
        print(f"gpu-kit: {len(held)} wheels, {mib:.1f} MiB (limit {LIMIT_MIB} MiB) in {kit}")
        if mib > LIMIT_MIB:
            print(f"gpu-kit: over {LIMIT_MIB} MiB", file=sys.stderr)
            return 1
        taken = resolves_offline(kit, Path(scratch))
    outside = [f"{n}-{v}-py3-none-any.whl" for n, v in OUTSIDE.items()]
    if taken != sorted(held + outside):
        print(f"gpu-kit: pip's offline resolution is not the kit: missing {sorted(set(taken) - set(held + outside))}, "
              f"unused {sorted(set(held) - set(taken))}", file=sys.stderr)
        return 1
    print(f"gpu-kit: pip resolves megatron-bitdet and {MEGATRON_CORE} from it alone for CPython {PYTHON} "
          f"manylinux x86_64, {', '.join(OUTSIDE)} from outside; every wheel taken")
    return 0


if __name__ == "__main__":
    sys.exit(main())
