"""Shared real training runs: every 2-rank launch costs ~20 s here, so each run is made once per
session and read by every test that needs it (test_train, test_checkpoint).

Also the ``megatron_lm`` marker: tests that drive Megatron-LM's own pretrain_*.py skip, naming why,
when ``MEGATRON_LM_PATH`` holds no checkout; with ``BITDET_REQUIRE_MEGATRON_LM=1`` (``.ci/run``) such a
skip is a failure instead; every run closes (above pytest's tally) with a line counting the Megatron-LM tests
that ran.

And the megatron-core leg (``--megatron-core-leg``, ``make test-mcore-0.19``): the run leaves out the test files in
``MEGATRON_CORE_FREE``, which never run megatron-core's code, and every run closes with a line naming the
megatron-core version it ran on and its counts (``.ci/run`` prints it per leg)."""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_bitdet.compat.cpu_backend import eager_jit_fuser

eager_jit_fuser()  # this process's megatron fused functions run eagerly, as every CPU rank's: no Inductor build here

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "nemotron_h_tiny.yaml"
ITERATIONS = 4  # > warmup_iters (2)
RESUME_AT = 2  # the reference saves every step; the resumed run restores 2 and runs 3-4 (both at lr > 0)


@dataclass(frozen=True)
class Run:
    dir: Path
    rc: int

    def fingerprint_bytes(self, rank: int) -> bytes:
        return (self.dir / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes()

    def fingerprint_lines(self, rank: int) -> list[bytes]:
        return self.fingerprint_bytes(rank).splitlines(keepends=True)

    def steps(self, rank: int) -> list[dict]:
        return [json.loads(line) for line in self.fingerprint_lines(rank)]

    def manifest(self) -> dict:
        return json.loads((self.dir / "manifest.json").read_text())


def train(run_dir: Path, *overrides: str, **launch_kwargs) -> Run:
    """One real 2-rank gloo training run of the tiny hybrid recipe (in-process launcher, spawned ranks)."""
    from megatron_bitdet.recipe import load_recipe
    from megatron_bitdet.train.run import RunOptions, launch_training

    recipe = load_recipe(str(RECIPE), [f"training.iterations={ITERATIONS}", *overrides])
    return Run(run_dir, launch_training(recipe, RunOptions(nproc=2, run_dir=run_dir, **launch_kwargs)))


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Run:
    """The default recipe (EP2, alltoall, distributed optimizer): a checkpoint every step, a live
    snapshot at RESUME_AT."""
    return train(tmp_path_factory.mktemp("reference"), save_interval=1, snapshot_at=[RESUME_AT])


@pytest.fixture(scope="session")
def resumed_run(tmp_path_factory, reference_run) -> Run:
    """Resumes the reference from its checkpoint at RESUME_AT (snapshot right after the restore)."""
    assert reference_run.rc == 0
    load = reference_run.dir / "checkpoints" / f"iter_{RESUME_AT:07d}"
    return train(tmp_path_factory.mktemp("resumed"), load=str(load), snapshot_at=[RESUME_AT])


@pytest.fixture(scope="session")
def saved_checkpoint(reference_run) -> Path:
    """One real checkpoint directory (the reference's iteration RESUME_AT) for tests that read it or
    corrupt it; copy it before changing anything."""
    assert reference_run.rc == 0
    return reference_run.dir / "checkpoints" / f"iter_{RESUME_AT:07d}"


# ---------------------------------------------------------------------------- Megatron-LM tests
MEGATRON_LM_MARK = "megatron_lm"
REQUIRE_MEGATRON_LM = "BITDET_REQUIRE_MEGATRON_LM"


def megatron_lm_missing() -> str | None:
    """Why Megatron-LM's training sources cannot be used here, or None when they can."""
    path = os.environ.get("MEGATRON_LM_PATH")
    if not path:
        return "MEGATRON_LM_PATH is unset (point it at a Megatron-LM checkout, tag core_v0.16.1)"
    if not os.path.isfile(os.path.join(path, "pretrain_mamba.py")):
        return f"MEGATRON_LM_PATH={path} holds no pretrain_mamba.py (point it at a Megatron-LM checkout)"
    return None


# ---------------------------------------------------------------------------- the megatron-core leg
MEGATRON_CORE_LEG = "--megatron-core-leg"
# The one list of what the megatron-core leg leaves out: test files none of whose tests runs megatron-core's code
# (nor Megatron-LM's), so another megatron-core version cannot change their outcome. Every other file runs.
MEGATRON_CORE_FREE = {
    "test_bench_fingerprint_scale.py": "docs/SCALE.md's cost model: arithmetic on the formula",
    "test_bench_trace_training.py": "the benchmark's verdict statistics and its argument check",
    "test_catalog.py": "the known-sources catalog as data",
    "test_ci_skips.py": "this conftest's skip rules and .ci/run's refusals, on stand-in test files",
    "test_compare.py": "compare on written fingerprint and TensorBoard files",
    "test_docs.py": "docs/ read against the package's source and CLI",
    "test_fingerprint_tensor.py": "tensor fingerprints of plain torch tensors",
    "test_kernel_rung.py": "the kernel rung on plain torch ops and the planted examples",
    "test_launch.py": "the launcher on plain child processes and gloo collectives",
    "test_megatron_lm_entry.py": "entry.run_as_main on stand-in scripts, no Megatron involved",
    "test_module_state.py": "generators and buffers of plain torch modules",
    "test_recipe.py": "the recipe schema and its error messages",
    "test_report.py": "report.html from written fingerprint files",
    "test_resources.py": "package data found through the installed package",
    "test_shards.py": "the per-step digests of plain CPU tensors",
    "test_trace.py": "per-rank traces of plain torch ops and gloo collectives",
    "test_wheel_install.py": "pip's resolution into a fresh venv: on Python 3.11 it takes megatron-core 0.16.1 by design",
}


def pytest_addoption(parser):
    parser.addoption(MEGATRON_CORE_LEG, action="store_true",
                     help="the megatron-core leg: leave out the test files in conftest.MEGATRON_CORE_FREE")


def pytest_collection_modifyitems(config, items):
    if not config.getoption(MEGATRON_CORE_LEG):
        return
    out = [item for item in items if item.path.name in MEGATRON_CORE_FREE]
    if out:
        config.hook.pytest_deselected(items=out)
        items[:] = [item for item in items if item.path.name not in MEGATRON_CORE_FREE]


def megatron_core_line(stats: dict, leg: bool) -> str:
    """The run's closing line: the megatron-core version it ran on and its counts (.ci/run prints it per leg)."""
    from importlib.metadata import version

    said = ", ".join(f"{len(stats.get(k, ()))} {k}" for k in ("passed", "failed", "error", "skipped", "deselected"))
    return (f"megatron-core {version('megatron-core')} (Python {platform.python_version()}): {said}"
            + (f" ({MEGATRON_CORE_LEG}: {len(MEGATRON_CORE_FREE)} megatron-core-free files left out)" if leg else ""))


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MEGATRON_LM_MARK}: drives Megatron-LM's pretrain_*.py (needs MEGATRON_LM_PATH)")


def pytest_runtest_setup(item):
    if item.get_closest_marker(MEGATRON_LM_MARK):
        why = megatron_lm_missing()
        if why:
            pytest.skip(why)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under BITDET_REQUIRE_MEGATRON_LM=1 a skipped Megatron-LM test fails: CI must not go green without them."""
    report = (yield).get_result()
    if report.skipped and item.get_closest_marker(MEGATRON_LM_MARK) and os.environ.get(REQUIRE_MEGATRON_LM) == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_MEGATRON_LM}=1 but this Megatron-LM test skipped: {reason}"
        report.user_properties.append((REQUIRE_MEGATRON_LM, "skip refused"))


MACHINE_OUTCOME = "machine_outcome"


@pytest.fixture
def machine_outcome(request):
    """For a test that accepts either of two outcomes the hardware decides (do 1 and 2 threads give the same
    bits?): records which one this machine gave, listed after the run (and in junit XML's properties)."""
    return lambda text: request.node.user_properties.append((MACHINE_OUTCOME, text))


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: its line comes after the short test summary
def pytest_terminal_summary(terminalreporter, config):
    """The lines after the skip reasons, before pytest's tally: the outcomes this machine chose (see
    machine_outcome), and how much of Megatron-LM's own training path this run covered."""
    yield
    for reports in terminalreporter.stats.values():
        for r in reports:
            if isinstance(r, pytest.TestReport) and r.when == "call":
                for key, text in r.user_properties:
                    if key == MACHINE_OUTCOME:
                        terminalreporter.write_line(f"this machine: {r.nodeid}: {text}")
    ran, failed, skipped, refused = set(), set(), set(), set()
    for reports in terminalreporter.stats.values():
        for r in reports:
            if not (isinstance(r, pytest.TestReport) and MEGATRON_LM_MARK in r.keywords):
                continue
            if (REQUIRE_MEGATRON_LM, "skip refused") in r.user_properties:
                refused.add(r.nodeid)
            elif r.skipped:
                skipped.add(r.nodeid)
            if r.when == "call" and not r.skipped:
                ran.add(r.nodeid)
            if r.failed:
                failed.add(r.nodeid)
    terminalreporter.write_line(megatron_core_line(terminalreporter.stats, config.getoption(MEGATRON_CORE_LEG)))
    line = f"Megatron-LM tests: {len(ran)} ran ({len(failed & ran)} failed), {len(skipped | refused)} skipped"
    if refused:
        line += f" ({len(refused)} counted as failures: {REQUIRE_MEGATRON_LM}=1)"
    if skipped | refused:
        line += f": {megatron_lm_missing() or 'see the skip reasons above'}"
    terminalreporter.write_line(line, red=bool(failed or skipped or refused), green=bool(ran) and not failed)


# ---------------------------------------------------------------------------- resume chains (tb)
# Shared by test_verify_resume and test_precision_runs: a faulted chain continues from an earlier
# chain's fresh segment instead of launching the same fresh run again.


def faulted_chain(recipe, resume_at, faults, *, fresh_segment, reference_dir, out_dir, nproc: int = 2):
    """verify_resume's chain with ``faults`` skipped on every restore, continuing from ``fresh_segment``
    (an earlier chain's fresh 0 -> resume_at[0] segment of the same recipe: faults act on restores only,
    so launching it again would repeat that run). Its outputs are compared with the reference as usual."""
    import shutil

    from megatron_bitdet.rundir import checkpoints_dir, iter_dir
    from megatron_bitdet.workflows.resume import recipe_segment, run_chain

    fresh_segment = Path(fresh_segment)
    assert iter_dir(checkpoints_dir(fresh_segment), resume_at[0]).is_dir(), fresh_segment
    launch = recipe_segment(recipe, nproc=nproc, faults=faults)

    def segment(run_dir: Path, start: int, stop: int, load_from, full=None) -> None:
        if start or full is not None:  # a second pass's fresh start runs: it keeps tensors in full
            launch(run_dir, start, stop, load_from, full=full)
        else:
            shutil.copytree(fresh_segment, run_dir)

    return run_chain(segment, name=recipe.name, steps=list(resume_at), iterations=recipe.training.iterations,
                     nproc=nproc, out_dir=Path(out_dir), reference_dir=Path(reference_dir), faults=faults)


# ---------------------------------------------------------------------------- two "nodes" (netns)
# Shared by test_topology (bitdet train under torchrun on each node) and test_launcher (workflows
# through --launcher templates).


def netns_available() -> str | None:
    """Why two network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "iproute2 / util-linux (ip, unshare) not installed"
    probe = f"bdprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


@dataclass(frozen=True)
class TwoNodes:
    """Two network namespaces joined by a veth pair; ``master`` is node 0's address."""

    nodes: list  # (namespace, veth device, address) per node
    master: str
    hosts: Path  # an /etc/hosts naming both nodes, beside an empty resolv.conf

    def prefix(self, i: int) -> list[str]:
        """The argv prefix that runs a command on node ``i``: its own UTS (host name ``node{i}``) and mount
        namespace (``hosts`` as /etc/hosts, so each records its own host and torchrun's rendezvous
        resolves it; no name server, which the namespace cannot reach: c10d's reverse lookups would wait
        out its timeouts), its network namespace, gloo on its veth, one thread per rank (torchrun's default)."""
        ns, dev, _ = self.nodes[i]
        resolv = self.hosts.with_name("resolv.conf")
        return ["unshare", "--uts", "--mount", "sh", "-c",
                f'hostname node{i} && mount --bind "{self.hosts}" /etc/hosts && '
                f'mount --bind "{resolv}" /etc/resolv.conf && exec "$@"', "node",
                "ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={dev}", "OMP_NUM_THREADS=1"]


@pytest.fixture
def two_nodes(tmp_path):
    """Two network namespaces joined by a veth pair (10.77.x.1 / 10.77.x.2), removed afterwards."""
    reason = netns_available()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    ns, dev, net = (f"bdA{tag}", f"bdB{tag}"), (f"va{tag}", f"vb{tag}"), f"10.77.{int(tag[:2], 16)}"
    cmds = [["ip", "netns", "add", ns[0]], ["ip", "netns", "add", ns[1]],
            ["ip", "link", "add", dev[0], "type", "veth", "peer", "name", dev[1]],
            ["ip", "link", "set", dev[0], "netns", ns[0]], ["ip", "link", "set", dev[1], "netns", ns[1]]]
    for i in (0, 1):
        cmds += [["ip", "-n", ns[i], "addr", "add", f"{net}.{i + 1}/24", "dev", dev[i]],
                 ["ip", "-n", ns[i], "link", "set", dev[i], "up"], ["ip", "-n", ns[i], "link", "set", "lo", "up"]]
    nodes = [(ns[i], dev[i], f"{net}.{i + 1}") for i in (0, 1)]
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{addr} node{i}\n" for i, (_, _, addr) in enumerate(nodes)))
    hosts.with_name("resolv.conf").write_text("")
    try:
        for cmd in cmds:
            subprocess.run(cmd, check=True, capture_output=True)
        yield TwoNodes(nodes, f"{net}.1", hosts)
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], check=False, capture_output=True)
