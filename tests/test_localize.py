"""`bitdet localize` on real traces: a planted order-dependent sum, a cross-rank receiver, bad input."""
import contextlib
import io
import json
import random
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_bitdet.analysis.localize import LocalizeConfig, localize_traces
from megatron_bitdet.cli import main
from megatron_bitdet.trace import Tracer, native, trace_path

_ORDER_SEED = {"seed": 0}


@torch.library.custom_op("bitdet_test::ordered_sum", mutates_args=())
def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """Sums rows in an order drawn from a per-run seed: a real order-dependent float reduction."""
    order = list(range(x.shape[0]))
    random.Random(_ORDER_SEED["seed"]).shuffle(order)
    acc = torch.zeros_like(x[0])
    for i in order:
        acc = acc + x[i]
    return acc


ordered_sum.register_autograd(lambda ctx, g: g.expand(ctx.rows, -1).contiguous(),
                               setup_context=lambda ctx, inputs, output: setattr(ctx, "rows", inputs[0].shape[0]))


class Mixer(torch.nn.Module):
    def forward(self, x):
        return ordered_sum(x).expand_as(x) * x


def run_planted(run_dir, order_seed, rank=0, world=1):
    _ORDER_SEED["seed"] = order_seed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), Mixer(), torch.nn.Linear(16, 4))
    data = torch.randn(64, 16) * 1000  # wide magnitudes: summation order changes the low bits
    with Tracer(run_dir, rank, world, level="op", steps=(2, 3)) as tr:
        tr.attach(model)
        for step in (1, 2, 3):
            with tr.step(step):
                with tr.phase("forward"):
                    loss = model(data).sum()
                with tr.phase("backward"):
                    loss.backward()


def bitdet(*args):
    """`bitdet localize ARGS` in this process (the CLI's own main; an uncaught exception fails the test as
    a traceback would): its exit code and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["localize", *map(str, args)])
    return types.SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


def test_identical_runs_have_no_mismatch(tmp_path):
    run_planted(tmp_path / "a", 1)
    run_planted(tmp_path / "b", 1)
    res = localize_traces(tmp_path / "a", tmp_path / "b")
    assert not res.mismatch and res.events_compared > 20 and res.culprit is None


def test_planted_order_dependence_is_localized_to_its_op(tmp_path):
    run_planted(tmp_path / "a", 1)
    run_planted(tmp_path / "b", 2)
    res = localize_traces(tmp_path / "a", tmp_path / "b")
    (f,) = [f for f in res.per_rank if f.classification != "match"]
    assert (f.rank, f.step, f.phase, f.module, f.op, f.classification) == (
        0, 2, "forward", "1", "bitdet_test.ordered_sum.default", "producer")
    assert f.inputs["a"] == f.inputs["b"] and f.outputs["a"] != f.outputs["b"]
    assert res.culprit["rank"] == 0 and res.culprit["op"] == f.op
    proc = bitdet(tmp_path / "a", tmp_path / "b", "--json")
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["per_rank"][0]["module"] == "1" and out["culprit"]["classification"] == "producer"
    assert bitdet(tmp_path / "a", tmp_path / "a").returncode == 0


def test_untraced_write_is_flagged_one_hop_later(tmp_path):
    """A write that bypasses ATen (here numpy, like a custom kernel) shows up at the next trivial op;
    the lead-in makes the trace span several of the comparator's 1 MiB chunks."""
    for name, poke in (("a", 0.0), ("b", 1.0)):
        with Tracer(tmp_path / name, 0, 1, level="op", steps=(1, 1)) as tr:
            with tr.step(1):
                z = torch.zeros(4)
                for _ in range(12000):
                    z = z + 1
                y = torch.ones(8) * 3
                y.numpy()[0] += poke
                (y + 1).sum()
    assert trace_path(tmp_path / "a", 0).stat().st_size > 1 << 20
    res = localize_traces(tmp_path / "a", tmp_path / "b")
    (f,) = [f for f in res.per_rank if f.classification != "match"]
    assert f.op == "aten.add.Tensor" and f.classification == "dispatcher_blind_spot"
    assert "one hop later" in f.detail and res.culprit["false_alarm"]
    line = trace_path(tmp_path / "b", 0).read_text().splitlines()[f.line - 1]
    assert json.loads(line)["out"] == f.outputs["b"] and f.events == f.line - 1


def test_reading_uninitialized_memory_is_never_blamed(tmp_path, machine_outcome):
    """What torch.empty holds is the allocator's: each run first frees blocks of the same size filled with its
    own value (outside the traced step), which malloc usually hands back. Either way no mismatch: reads of
    differing garbage are counted as ignored (never a producer), equal garbage leaves nothing to ignore."""
    read = {}
    for name, junk in (("a", 1.0), ("b", 2.0)):
        with Tracer(tmp_path / name, 0, 1, level="op", steps=(1, 1)) as tr:
            planted = [torch.full((1 << 12,), junk) for _ in range(4)]  # 16 KiB: below malloc's mmap threshold
            del planted
            with tr.step(1):
                garbage = [torch.empty(1 << 12) for _ in range(4)]
                [g.sum() for g in garbage]
            read[name] = [g.clone() for g in garbage]
            del garbage
    differing = sum(not torch.equal(x, y) for x, y in zip(read["a"], read["b"]))
    machine_outcome(f"torch.empty's garbage differed between the runs in {differing} of 4 buffers")
    res = localize_traces(tmp_path / "a", tmp_path / "b")
    assert not res.mismatch and res.events_compared == 8, res.to_json()
    assert sum(f.ignored for f in res.per_rank) == differing  # each differing read seen, and ignored


def _recv_worker(rank, run_dir, rdzv, order_seed):
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2)
    _ORDER_SEED["seed"] = order_seed if rank == 0 else 0
    with Tracer(run_dir, rank, 2, level="op", steps=(1, 1)) as tr:
        with tr.step(1):
            buf = torch.zeros(16)
            if rank == 0:
                x = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16).sin() * 1000
                buf = ordered_sum(x)
                dist.send(buf, dst=1)
            else:
                dist.recv(buf, src=0)
            (buf * 2).sum()
    dist.destroy_process_group()


def test_receiver_names_the_sending_rank(tmp_path):
    for name, seed in (("a", 1), ("b", 2)):
        mp.spawn(_recv_worker, args=(str(tmp_path / name), str(tmp_path / f"rdzv_{name}"), seed), nprocs=2)
    res = localize_traces(tmp_path / "a", tmp_path / "b")
    by_rank = {f.rank: f for f in res.per_rank}
    assert by_rank[0].classification == "producer" and by_rank[0].op == "bitdet_test.ordered_sum.default"
    assert by_rank[1].classification == "receiver" and by_rank[1].peers == [0] and by_rank[1].op == "recv"
    assert res.culprit["rank"] == 0 and res.culprit["classification"] == "producer"
    assert res.culprit["receivers"] == [1]


def test_bad_traces_exit_2_naming_the_file(tmp_path):
    run_planted(tmp_path / "a", 1)
    run_planted(tmp_path / "b", 1)
    path = trace_path(tmp_path / "b", 0)
    good = path.read_bytes()
    lines = good.split(b"\n")
    lines[5] = lines[5][: len(lines[5]) // 2]  # torn record in the middle
    path.write_bytes(b"\n".join(lines))
    proc = bitdet(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 2 and f"{path}:6" in proc.stderr
    path.write_bytes(b'{"hello": 1}\n' + good.split(b"\n", 1)[1])  # foreign header
    proc = bitdet(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 2 and str(path) in proc.stderr and "foreign" in proc.stderr
    for cut in (good[:-10], good[:len(good) // 2]):  # crashed while writing: at the end, in the middle
        path.write_bytes(cut if not cut.endswith(b"\n") else cut[:-1])
        proc = bitdet(tmp_path / "a", tmp_path / "b", "--json")
        out = json.loads(proc.stdout)
        assert proc.returncode == 2 and not out["mismatch"], proc.stderr  # no mismatch, yet not a match
        assert "truncated record" in out["incomplete"][0] and "not a match" in proc.stderr
    path.unlink()
    proc = bitdet(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 2 and "rank_00000.trace.jsonl" in proc.stderr


@pytest.mark.parametrize("field, value, message", [
    ("in", 5, "'in' must be a list of digests"),
    ("in", ["garbage"], "'in' must be a list of digests"),
    ("out", [5], "'out' must be a list of digests"),
    ("step", "x", "'step' and 'n' must be integers"),
    ("scope", None, "'scope' must be a string"),
    ("phase", 1, "'phase' must be a string"),
    ("header.world_size", "2", "header's rank, world_size or ranks"),
    ("header.ranks", 7, "header's rank, world_size or ranks"),
])
def test_a_record_or_header_of_the_wrong_shape_is_refused(tmp_path, field, value, message):
    """Valid JSON, wrong types: refused naming file:line, never read as a benign difference (a record
    whose outputs still match) or a traceback."""
    run_planted(tmp_path / "a", 1)
    run_planted(tmp_path / "b", 1)
    path = trace_path(tmp_path / "b", 0)
    lines = path.read_bytes().split(b"\n")
    where, _, key = field.rpartition(".")
    i = 0 if where == "header" else 1
    lines[i] = json.dumps({**json.loads(lines[i]), key: value}).encode()
    path.write_bytes(b"\n".join(lines))
    proc = bitdet(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 2 and f"{path}:{i + 1}: " in proc.stderr and message in proc.stderr, proc.stderr


def test_one_extra_event_on_either_side_is_a_control_divergence(tmp_path):
    """Run B's trace = run A's minus its last record (or two): more events in A, in either order."""
    run_planted(tmp_path / "a", 1)
    full = trace_path(tmp_path / "a", 0).read_bytes().splitlines(keepends=True)
    for drop in (1, 2):
        run_planted(tmp_path / "b", 1)
        trace_path(tmp_path / "b", 0).write_bytes(b"".join(full[:-drop]))
        compared = len(full) - 1 - drop  # records both traces hold (the header is not one)
        for first, second, longer in (("a", "b", "a"), ("b", "a", "a")):
            res = localize_traces(tmp_path / first, tmp_path / second)
            f = res.per_rank[0]
            assert res.mismatch and f.classification == "control_divergence", (drop, first, f)
            extra = json.loads(full[compared + 1])  # the first record only the longer trace holds
            assert f.detail.startswith(f"{trace_path(tmp_path / longer, 0)} has more events after event {compared}, "
                                       f"the first {f.event_id}")
            assert (f.step, f.phase, f.op, f.line) == (extra["step"], extra["phase"], extra["name"], compared + 2)
            assert res.culprit["step"] == extra["step"] and res.culprit["event_id"] == f.event_id


def test_traces_without_events_are_not_a_match(tmp_path):
    """A traced window no step reached: header-only traces on both sides compare nothing (exit 2)."""
    for run in ("a", "b"):
        with Tracer(tmp_path / run, 0, 1, level="op", steps=(5, 6)) as tr:
            with tr.step(1):
                torch.ones(3).sum()
    proc = bitdet(tmp_path / "a", tmp_path / "b", "--json")
    out = json.loads(proc.stdout)
    assert proc.returncode == 2 and not out["mismatch"] and out["events_compared"] == 0
    assert "neither trace holds an event" in out["incomplete"][0] and "not a match" in proc.stderr


def test_traces_of_different_op_tracers_are_refused(tmp_path, monkeypatch):
    """A Python dispatch mode makes torch take other paths (functional index_add / scatter_add, view for
    reshape, cloned gradients) than the native tracer sees: aligning their records would report
    control divergences that are not there."""
    run_planted(tmp_path / "a", 1)
    monkeypatch.setenv(native.ENV, "python")
    run_planted(tmp_path / "b", 1)
    proc = bitdet(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 2, proc.stdout
    assert f"{trace_path(tmp_path / 'b', 0)}:1: op_tracer 'python' differs" in proc.stderr


def test_a_producer_on_one_rank_beats_a_false_alarm_on_another(tmp_path):
    """Per-rank orders say nothing about which rank went first: rank 0's blind spot must not hide
    rank 1's producer (the only one whose equal inputs gave differing outputs)."""
    for name, poke, seed in (("a", 0.0, 0), ("b", 1.0, 1)):
        with Tracer(tmp_path / name, 0, 2, level="op", steps=(1, 1)) as tr:
            with tr.step(1):
                y = torch.ones(8) * 3
                y.numpy()[0] += poke
                (y + 1).sum()
        _ORDER_SEED["seed"] = seed
        with Tracer(tmp_path / name, 1, 2, level="op", steps=(1, 1)) as tr:
            with tr.step(1):
                ordered_sum(torch.randn(64, 16, generator=torch.Generator().manual_seed(0)) * 1000)
    res = localize_traces(tmp_path / "a", tmp_path / "b", LocalizeConfig(workers=1))
    assert {f.rank: f.classification for f in res.per_rank} == {0: "dispatcher_blind_spot", 1: "producer"}
    assert res.culprit["rank"] == 1 and res.culprit["op"] == "bitdet_test.ordered_sum.default"
