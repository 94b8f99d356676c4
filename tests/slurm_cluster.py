"""A real one-node Slurm cluster on this machine for the tests (``slurm_cluster``, one per test module that
uses it: started in about a second, it does not idle through the rest of the session):
``munged``, ``slurmctld`` and ``slurmd`` from Debian's packages (``slurm-wlm``, ``munge``: ``.ci/run``
installs them), each started in the foreground as a child of the test process, from a minimal
``slurm.conf`` written into a temporary folder (``SLURM_CONF`` points every client there; no Slurm or
munge configuration under /etc is used or written): one node named after this host, ``CPUs=2``,
``proctrack/linuxproc``, ``task/none``, munge on its own socket, ports the OS picked.

The daemons do not outlive the module: each is stopped at its end (jobs cancelled first), and each dies
with the test process if that is killed (the parent-death signal), so a restarted session starts from
nothing (a new folder, new ports, ``slurmctld -c``: no state read back).

Without the packages (or root, which slurmd's task launch needs) the fixture skips naming why; with
``BITDET_REQUIRE_SLURM=1`` (``.ci/run``) that is a failure instead: CI must not go green without them.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REQUIRE_SLURM = "BITDET_REQUIRE_SLURM"
PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scancel", "squeue")
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


def slurm_missing() -> str | None:
    """Why a Slurm cluster cannot be started here, or None when it can."""
    absent = [p for p in PROGRAMS if shutil.which(p) is None]
    if absent:
        return (f"Slurm / munge not installed ({', '.join(absent)} not on PATH): apt-get install slurm-wlm munge "
                "(.ci/run does)")
    if os.geteuid() != 0:
        return "the one-node Slurm cluster runs its daemons as root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class SlurmCluster:
    """The running cluster: ``env`` (SLURM_CONF) is what a client (srun, sbatch) needs."""

    dir: Path
    node: str
    procs: list
    start_s: float

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(list(argv), env={**os.environ, **self.env}, capture_output=True, text=True, **kwargs)

    def logs(self, pattern: str = "*.log", chars: int = 3000) -> str:
        """The end of each daemon file matching ``pattern`` (their logs; ``*.out``: their consoles)."""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}"
                         for p in sorted(self.dir.glob(pattern)))

    def stop(self) -> None:
        """Cancel what is still queued or running, then stop slurmd, slurmctld and munged in that order."""
        if any(p.args[0] == "slurmctld" and p.poll() is None for p in self.procs):
            try:
                self.run("scancel", "--full", "--user", "root", timeout=30)
                deadline = time.monotonic() + STOP_GRACE_S
                while time.monotonic() < deadline and self.run("squeue", "-h", timeout=30).stdout.strip():
                    time.sleep(0.5)
            except subprocess.TimeoutExpired:
                pass  # an unresponsive controller: the daemons are stopped below all the same
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()


def _config(d: Path, node: str, munge_socket: Path) -> str:
    return "\n".join([
        "ClusterName=bitdet",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={d / 'state'}",
        f"SlurmdSpoolDir={d / 'spool'}",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}",
        f"SlurmdPidFile={d / 'slurmd.pid'}",
        f"SlurmctldLogFile={d / 'slurmctld.log'}",
        f"SlurmdLogFile={d / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/builtin",
        "MpiDefault=none",
        "ReturnToService=2",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SlurmdParameters=config_overrides",  # CPUs=2 whatever this machine has
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN",
        f"PartitionName=bitdet Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def start(d: Path) -> SlurmCluster:
    """munged, slurmctld and slurmd from a fresh ``d``; returns once the node is idle (or raises with the
    daemons' logs, having stopped what it started)."""
    began = time.monotonic()
    d.mkdir(parents=True, exist_ok=True)
    for sub in ("munge", "state", "spool"):
        (d / sub).mkdir(mode=0o700, exist_ok=True)
    key, sock = d / "munge" / "munge.key", d / "munge" / "munge.sock"
    subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True, capture_output=True)
    node = socket.gethostname().split(".")[0]
    (d / "slurm.conf").write_text(_config(d, node, sock))
    daemons = [
        ["munged", "--foreground", "--force", f"--socket={sock}", f"--key-file={key}", f"--log-file={d / 'munged.log'}",
         f"--pid-file={d / 'munge' / 'munged.pid'}", f"--seed-file={d / 'munge' / 'seed'}"],
        ["slurmctld", "-D", "-c", "-f", str(d / "slurm.conf")],
        ["slurmd", "-D", "-f", str(d / "slurm.conf")],
    ]
    cluster = SlurmCluster(d, node, [], 0.0)
    try:
        for argv in daemons:
            with open(d / f"{argv[0]}.out", "wb") as out:
                cluster.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                                      stderr=subprocess.STDOUT, preexec_fn=_die_with_parent))
            if argv[0] == "munged":  # the socket must exist before slurmctld authenticates anything
                _wait(lambda: sock.exists(), cluster, "munged to create its socket")
        _wait(lambda: cluster.run("sinfo", "-h", "-n", node, "-o", "%t", timeout=30).stdout.strip() == "idle",
              cluster, f"node {node} to be idle")
    except BaseException:
        cluster.stop()
        raise
    cluster.start_s = time.monotonic() - began
    return cluster


def _wait(ready, cluster: SlurmCluster, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        dead = [p.args[0] for p in cluster.procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"the one-node Slurm cluster did not start (waiting for {what}; "
                               f"{'exited: ' + ', '.join(dead) if dead else f'{START_TIMEOUT_S:.0f} s'}):\n"
                               f"{cluster.logs('*.out', 2000)}\n{cluster.logs()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """The running one-node cluster, SLURM_CONF set in this process while it runs (bitdet's --launcher runs
    srun from here); skipped naming why when Slurm cannot run here, failed instead under
    BITDET_REQUIRE_SLURM=1."""
    why = slurm_missing()
    if why:
        if os.environ.get(REQUIRE_SLURM) == "1":
            pytest.fail(f"{REQUIRE_SLURM}=1 but the Slurm tests cannot run: {why}", pytrace=False)
        pytest.skip(why)
    cluster = start(tmp_path_factory.mktemp("slurm", numbered=True))
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        cluster.stop()
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
