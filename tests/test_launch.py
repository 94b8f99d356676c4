"""The launcher on real child processes and real gloo collectives."""
import json
import os
import socket
import subprocess
import sys
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
