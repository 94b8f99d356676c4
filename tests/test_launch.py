"""The launcher on real child processes and real gloo collectives."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.train.launch import launch

TESTS = str(Path(__file__).parent)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    return {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])), **extra}


@pytest.mark.timeout(120)
def test_two_rank_allreduce_succeeds_with_logs_and_env(tmp_path, capfd):
    rc = launch("dist_workers:allreduce", 2, {"out": str(tmp_path)}, run_dir=tmp_path / "run",
                env=_env(BITDET_TEST_MARK="from-parent"))
    assert rc == 0
    results = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert (tmp_path / "helper").read_text() == "helper ran"
    assert {r["backend"] for r in results} == {"gloo"}
    assert [r["env"]["RANK"] for r in results] == ["0", "1"]
    for r in results:
        assert r["env"]["WORLD_SIZE"] == r["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert r["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert r["env"]["BITDET_TEST_MARK"] == "from-parent"  # env reaches children
        assert r["pid"] != os.getpid()
    logs = tmp_path / "run" / "logs"
    assert "rank 1 sum 3.0" in (logs / "rank_00001.log").read_text()
    out = capfd.readouterr().out
    assert "rank 0 sum 3.0" in out and "rank 1 sum" not in out  # only rank 0 streams to the console


@pytest.mark.timeout(90)
def test_exception_on_rank1_is_named_and_rank0_does_not_hang(tmp_path, capfd):
    rc = launch("dist_workers:raise_on", 2, {"bad_rank": 1}, run_dir=tmp_path, env=_env())
    err = capfd.readouterr().err
    assert rc == 1
    assert "rank 1 of 2 failed (exit code 1)" in err
    assert "RuntimeError: deliberate failure on rank 1" in err
    assert "rank_00001.log" in err


@pytest.mark.timeout(90)
def test_killed_rank_is_named(tmp_path, capfd):
    rc = launch("dist_workers:sigkill_on", 2, [1], env=_env())
    err = capfd.readouterr().err
    assert rc == 128 + 9
    assert "rank 1 of 2 failed (killed by signal SIGKILL)" in err


@pytest.mark.timeout(90)
def test_killed_rank_is_named_when_its_exit_is_seen_second(capfd):
    rc = launch("dist_workers:fail_then_peer_killed", 2, [], env=_env())
    err = capfd.readouterr().err
    assert rc == 128 + 9 and "rank 1 of 2 failed (killed by signal SIGKILL)" in err


@pytest.mark.timeout(60)
def test_bad_worker_path_is_input_error(capfd):
    assert launch("dist_workers:no_such_function", 1, {}, env=_env()) == 2
    assert "cannot load worker" in capfd.readouterr().err
    with pytest.raises(BitdetInputError):
        launch("no-colon", 0, {})


@pytest.mark.timeout(60)
def test_under_torchrun_runs_in_process(tmp_path):
    """With torchrun's variables set, launch spawns nothing: the worker runs in the calling process."""
    code = ("import os, sys, json; from megatron_bitdet.train.launch import launch; "
            f"rc = launch('dist_workers:allreduce', 1, {{'out': {str(tmp_path)!r}}}); "
            f"open({str(tmp_path / 'caller.json')!r}, 'w').write(json.dumps(os.getpid())); sys.exit(rc)")
    env = {**os.environ, **_env(), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}  # torchrun's part
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    worker = json.loads((tmp_path / "rank_0.json").read_text())
    assert worker["pid"] == json.loads((tmp_path / "caller.json").read_text())
    assert worker["sum"] == 1.0


def test_torchrun_world_mismatch_is_input_error(monkeypatch):
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(BitdetInputError, match="torchrun started 1 processes but this run needs 2"):
        launch("dist_workers:allreduce", 2, {})


def _torchrun_rank(tmp_path, code: str, *flags: str) -> subprocess.CompletedProcess:
    """One rank as torchrun starts it: its variables set, no PYTHONHASHSEED exported (str hashing randomized)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.update(_env(), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    prologue = (f"import os, sys; sys.path.insert(0, {TESTS!r}); "
                f"open({str(tmp_path / 'starts')!r}, 'a').write(f'{{os.getpid()}}\\n'); ")
    return subprocess.run([sys.executable, *flags, "-c", prologue + code], env=env, capture_output=True, text=True,
                          timeout=150)  # two interpreter starts (the re-exec) on a loaded machine


@pytest.mark.timeout(200)
def test_torchrun_rank_hashes_with_the_pythonhashseed_it_records(tmp_path):
    """PYTHONHASHSEED only works from the interpreter's start: a torchrun rank started randomized is
    re-executed in place (same PID, so torchrun still supervises it) with the variable set."""
    code = (f"from megatron_bitdet.train.launch import launch; "
            f"sys.exit(launch('dist_workers:hash_state', 1, {{'out': {str(tmp_path)!r}}}, env={{'PYTHONHASHSEED': '0'}}))")
    proc = _torchrun_rank(tmp_path, code)
    assert proc.returncode == 0, proc.stderr
    worker = json.loads((tmp_path / "worker.json").read_text())
    fixed = subprocess.run([sys.executable, "-c", "print(hash('bitdet'))"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": "0"}).stdout
    assert (worker["hash_randomization"], worker["hash"], worker["env"]) == (0, int(fixed), "0")
    starts = (tmp_path / "starts").read_text().split()
    assert len(starts) == 2 and set(starts) == {str(worker["pid"])}


@pytest.mark.timeout(200)
def test_torchrun_rank_that_ignores_pythonhashseed_is_refused_with_the_launcher_fix(tmp_path):
    """``python -E`` ignores PYTHONHASHSEED even after the re-exec: exit 2, saying what to change."""
    code = ("from megatron_bitdet.cli import main; "
            f"sys.exit(main(['train', '--recipe', 'nemotron_h_tiny', '--nproc', '1', '--run-dir', {str(tmp_path / 'run')!r}, 'parallel.expert=1']))")
    proc = _torchrun_rank(tmp_path, code, "-E")
    assert proc.returncode == 2, proc.stderr
    assert "PYTHONHASHSEED=0 torchrun" in proc.stderr and "-E" in proc.stderr and "Traceback" not in proc.stderr
    assert len((tmp_path / "starts").read_text().split()) == 2  # refused after one re-exec, not in a loop


@pytest.mark.parametrize("worker, backend, expected", [
    ("cuda_order", "gloo", ["enforce", "set_device(0)", "worker"]),
    ("cuda_order_own_group", None, ["worker"]),  # Megatron-LM sets the device after its own enforcement hook
])
def test_rank_touches_cuda_only_after_enforcement(worker, backend, expected, monkeypatch):
    """Stand-in for a CUDA machine (absent here): ``is_available`` says yes, ``set_device`` (which
    creates the CUDA context) is recorded. A context made before enforcement would have read
    CUDA_DEVICE_MAX_CONNECTIONS and cuBLAS's workspace before they were set."""
    import torch

    import dist_workers
    from megatron_bitdet.train.launch import run_rank

    monkeypatch.syspath_prepend(TESTS)
    monkeypatch.setattr(dist_workers, "CUDA_EVENTS", events := [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: events.append(f"set_device({d})"))
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    assert run_rank(f"dist_workers:{worker}", {}, backend=backend) == 0
    assert events == expected


@pytest.mark.timeout(120)
def test_a_sigterm_to_the_launcher_ends_its_ranks(tmp_path):
    """``timeout``, ``scancel`` and a job's end send SIGTERM to the launcher; its ranks (own process groups)
    must not outlive it."""
    import psutil

    program = ("import sys; from megatron_bitdet.train.launch import launch; "
               f"sys.exit(launch('dist_workers:pid_then_wait', 2, {{'out': {str(tmp_path)!r}}}))")
    parent = subprocess.Popen([sys.executable, "-c", program], env={**os.environ, **_env()})
    try:
        pids = [tmp_path / f"pid_{r}" for r in range(2)]
        for _ in range(600):
            if all(p.is_file() and p.read_text() for p in pids):
                break
            assert parent.poll() is None, "the launcher ended before its ranks started"
            time.sleep(0.1)
        ranks = [psutil.Process(int(p.read_text())) for p in pids]
        parent.send_signal(signal.SIGTERM)
        rc = parent.wait(timeout=60)
        gone, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks outlived the launcher: {[p.pid for p in alive]}"
        assert rc == 128 + signal.SIGTERM
    finally:
        parent.kill()
        for p in (tmp_path / f"pid_{r}" for r in range(2)):
            if p.is_file() and psutil.pid_exists(int(p.read_text())):
                psutil.Process(int(p.read_text())).kill()
