"""The kernel rung on real ops, without training: an op occurrence captured inside a traced window
(by its run-independent event id, inputs cloned before the op), written per rank, read back with
weights_only, replayed in a fresh process under several configurations; verdicts for a thread-ordered
accumulation (planted: the real CPU index_put_(accumulate)'s race need not happen on a given CPU and run;
that one is test_fixcheck's), an order drawn inside the kernel (the planted atomic sum),
a deterministic op, and differing configurations between two runs. Bad capture files exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_bitdet.analysis.kernel_replay import replay_op
from megatron_bitdet.cli import main
from megatron_bitdet.trace import Tracer
from megatron_bitdet.rundir import capture_path
from megatron_bitdet.trace.capture import load_capture, rebuild

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(240)


def _capture(run_dir, fn, event_id):
    with Tracer(run_dir, 0, 1, level="op", steps=(1, 1), capture={"rank": 0, "event_id": event_id}) as tr:
        with tr.step(1):
            fn()
    return capture_path(run_dir, 0)


def test_thread_ordered_accumulation_is_thread_order_with_a_deterministic_variant(tmp_path, monkeypatch):
    """The planted index_put_(accumulate)-style sum (examples.planted_nondeterminism.thread_order_index_add):
    its order varies whenever threads would race, where the real kernel's race may not happen in a run."""
    monkeypatch.chdir(ROOT)  # the replay process imports the op's defining module from here
    from examples.planted_nondeterminism import thread_order_index_add

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 8, (4096,), generator=g)  # few rows: many repeated indices
    vals = torch.randn(4096, 64, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        paths = [_capture(tmp_path / r, lambda: thread_order_index_add(vals, idx, 8),
                          "1/forward//bitdet_example.thread_order_index_add.default#0") for r in "ab"]
    finally:
        torch.set_num_threads(threads)
    rec = load_capture(paths[0])
    assert rec["op"] == "bitdet_example.thread_order_index_add.default" and rec["threads"] == 2
    assert rec["home"] == "examples.planted_nondeterminism" and rec["args"][2] == 8
    v = replay_op(*paths, repeats=10, threads=[1, 2])
    by = {c["label"]: c for c in v.configs}
    assert by["as recorded (2 threads)"]["distinct"] > 1
    assert by["1 thread"]["distinct"] == 1 and by["deterministic algorithms (2 threads)"]["distinct"] == 1
    assert v.mechanism == "thread_scheduling" and v.deterministic_variant == "yes"
    assert v.verdict.startswith("bitdet_example.thread_order_index_add.default — ")
    assert "1 at 1 thread, 1 with deterministic algorithms" in v.verdict and "torch has a deterministic variant" in v.verdict
    assert "captured inputs identical in both runs" in v.evidence


def test_planted_atomic_sum_varies_inside_the_kernel(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the replay process imports the op's defining module from here
    from examples.planted_nondeterminism import atomic_sum

    parts = torch.randn(8, 4096, generator=torch.Generator().manual_seed(1))
    path = _capture(tmp_path / "a", lambda: atomic_sum(parts), "1/forward//bitdet_example.atomic_sum.default#0")
    assert load_capture(path)["home"] == "examples.planted_nondeterminism"
    capsys.readouterr()
    assert main(["replay-op", str(tmp_path / "a"), "--repeats", "10", "--threads", "1,2", "--json"]) == 0
    v = json.loads(capsys.readouterr().out)  # the CLI's own verdict (one replay process, not two)
    assert v["event_id"] == "1/forward//bitdet_example.atomic_sum.default#0"
    assert v["mechanism"] == "order_inside_kernel" and v["deterministic_variant"] == "no"
    assert "varies on one thread too" in v["verdict"]


def test_deterministic_op_and_differing_configurations(tmp_path):
    x = torch.randn(64, 32).t()  # recorded strides are not contiguous
    paths = []
    for r, dim in (("a", 0), ("b", 1)):
        paths.append(_capture(tmp_path / r, lambda dim=dim: torch.cumsum(x, dim), "1/forward//aten.cumsum.default#0"))
    rec = load_capture(paths[0])
    assert rec["inputs"][0]["stride"] == [1, 32] and rebuild(rec["inputs"][0], strided=True).stride() == (1, 32)
    alone = replay_op(paths[0], repeats=5, threads=[1, 2])
    assert alone.mechanism == "deterministic_in_isolation" and all(c["distinct"] == 1 for c in alone.configs)
    both = replay_op(*paths, repeats=5, threads=[1, 2])
    assert both.mechanism == "runtime_configuration" and "dim: 0 vs 1" in both.verdict


def test_capture_size_bound_and_bad_files_exit_2(tmp_path, capsys):
    big = torch.zeros(1024)
    with Tracer(tmp_path / "big", 0, 1, level="op", steps=(1, 1),
                capture={"rank": 0, "event_id": "1/forward//aten.add.Tensor#0", "max_bytes": 1000}) as tr:
        with tr.step(1):
            big + 1
    rec = load_capture(capture_path(tmp_path / "big", 0))
    assert "too_large" in rec and "data" not in rec["inputs"][0]
    assert main(["replay-op", str(capture_path(tmp_path / "big", 0))]) == 2
    assert "nothing to replay" in capsys.readouterr().err
    bad = tmp_path / "bad.capture.pt"
    for payload in (b"\x00\xffgarbage", b""):
        bad.write_bytes(payload)
        assert main(["replay-op", str(bad)]) == 2
        assert str(bad) in capsys.readouterr().err
    torch.save({"format": "something-else"}, bad)
    assert main(["replay-op", str(bad)]) == 2
    assert "foreign file" in capsys.readouterr().err
    assert main(["replay-op", str(tmp_path)]) == 2  # a directory without captures/
    assert "no capture" in capsys.readouterr().err


def test_a_capture_names_no_module_to_run_for_an_aten_op_nor_a_malformed_one(tmp_path, monkeypatch, capsys):
    """The capture is untrusted input: its 'home' is imported only to register a custom op that is not
    registered already, and only when it is a module path; a module in the current directory cannot
    take the place of one the replay imports (no current directory first on the worker's sys.path)."""
    path = _capture(tmp_path / "a", lambda: torch.ones(4, 4) @ torch.ones(4, 4), "1/forward//aten.mm.default#0")
    work = tmp_path / "cwd"
    work.mkdir()
    marker = tmp_path / "IMPORTED"
    for name in ("planted_home", "json"):  # one the capture names, one every replay imports
        (work / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r})\n")
    monkeypatch.chdir(work)
    rec = load_capture(path)
    rec["home"] = "planted_home"
    torch.save(rec, path)
    capsys.readouterr()
    assert main(["replay-op", str(path), "--repeats", "2", "--threads", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mechanism"] == "deterministic_in_isolation"
    assert not marker.exists()
    rec["op"], rec["home"] = "bitdet_nowhere.op.default", "planted_home; import os"
    torch.save(rec, path)
    assert main(["replay-op", str(path), "--repeats", "2", "--threads", "1"]) == 2
    assert "'home' is 'planted_home; import os', not a module path" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize("field, value, message", [
    ("threads", "2", "'threads' is str, expected int"),
    ("threads", 0, "'threads' or 'arg_names' is malformed"),
    ("deterministic_algorithms", None, "'deterministic_algorithms' is missing or not a bool"),
    ("args", [{"tensor": 7}, {"tensor": 1}], "args[0]: 'tensor' 7 is not an encoded argument"),
    ("args", [{"dtype": "no_such_dtype"}], "args[0]: 'dtype' 'no_such_dtype'"),
    ("kwargs", [], "'args' (a list) and 'kwargs' (a mapping) are required"),
    ("inputs", {"0": 1}, "'inputs' is missing or not a list"),
    ("outputs", [{"shape": [4, 4], "stride": [4], "dtype": "float32"}], "output 0 is malformed"),
    ("outputs", None, "'outputs' is missing or not a list"),
])
def test_a_capture_of_the_wrong_shape_exits_2_naming_the_field(tmp_path, capsys, field, value, message):
    """A capture torch.load reads (weights_only) but whose fields replay could not use: exit 2 naming the
    file and the field, before any replay process starts (was a traceback: 'the replay failed')."""
    path = _capture(tmp_path / "a", lambda: torch.ones(4, 4) @ torch.ones(4, 4), "1/forward//aten.mm.default#0")
    rec = load_capture(path)
    rec[field] = value
    torch.save(rec, path)
    capsys.readouterr()
    assert main(["replay-op", str(path), "--repeats", "2", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err, err
