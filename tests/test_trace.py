"""Per-rank traces: aligned across identical runs, zero footprint when off, inputs hashed before ops."""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_bitdet.trace import Tracer, native, open_trace, trace_path


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc1(x)
        h.mul_(2.0)  # in-place on a module output: hooks must cope
        return self.fc2(torch.relu(h)) + x


def run_model(run_dir, level, steps=(1, 2), n_steps=3, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(Block(), Block())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(4, 8)
    with Tracer(run_dir, 0, 1, level=level, steps=steps) as tr:
        tr.attach(model)
        for step in range(1, n_steps + 1):
            with tr.step(step):
                with tr.phase("forward"):
                    loss = model(data).square().mean()
                with tr.phase("backward"):
                    loss.backward()
                with tr.phase("optimizer"):
                    tr.event("params_before", dict(model.named_parameters()))
                    opt.step()
                    opt.zero_grad()
                    tr.event("params_after", dict(model.named_parameters()))
    return model


def records(run_dir, rank=0):
    lines = trace_path(run_dir, rank).read_text().splitlines()
    return json.loads(lines[0]), [json.loads(x) for x in lines[1:]]


def test_identical_runs_write_identical_traces(tmp_path):
    for level in ("semantic", "module", "op"):
        run_model(tmp_path / f"a_{level}", level)
        run_model(tmp_path / f"b_{level}", level)
        a = trace_path(tmp_path / f"a_{level}", 0).read_bytes()
        assert a == trace_path(tmp_path / f"b_{level}", 0).read_bytes(), level
    header, recs = records(tmp_path / "a_op")
    assert header["level"] == "op" and header["steps"] == [1, 2]
    assert {r["step"] for r in recs} == {1, 2}  # step 3 lies outside the window
    phases = {r["phase"] for r in recs}
    assert {"forward", "backward", "optimizer"} <= phases
    scopes = {r["scope"] for r in recs if r["phase"] == "backward" and r["k"] == "op"}
    assert {"0.fc1", "1.fc2"} <= scopes  # backward ops carry their module scope
    ids = [(r["step"], r["phase"], r["scope"], r["name"], r["n"]) for r in recs]
    assert len(ids) == len(set(ids))  # occurrence counts make every id unique


def test_module_level_records_forward_and_backward(tmp_path):
    run_model(tmp_path, "module", steps=(1, 1))
    _, recs = records(tmp_path)
    fwd = [r for r in recs if r["k"] == "module" and r["name"] == "forward"]
    assert [r["scope"] for r in fwd] == ["0.fc1", "0.fc2", "0", "1.fc1", "1.fc2", "1", "model"]
    bwd = {r["scope"] for r in recs if r["k"] == "module" and r["name"] == "backward"}
    assert {"1.fc2", "0.fc1"} <= bwd
    assert all(r["in"] and r["out"] for r in fwd)


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "graph"])
def test_tensor_hooks_leave_with_their_step(tmp_path, leaf):
    """A module input that lives across traced steps carries no hook of an earlier step: each step
    records the same module events, and nothing stays registered. A leaf needing grad gets Python
    tensor hooks; a non-leaf whose graph is retained across steps gets the native tracer's hooks on
    its grad_fn (a leftover one would add records to the later steps)."""
    torch.manual_seed(0)
    model, x = Block(), torch.randn(4, 8, requires_grad=True)
    if not leaf:
        x = x * 2
    with Tracer(tmp_path, 0, 1, level="module") as tr:
        tr.attach(model)
        for step in (1, 2, 3):
            with tr.step(step):
                model(x).sum().backward(retain_graph=not leaf)
            assert not x._backward_hooks
    recs = records(tmp_path)[1]
    per_step = [[(r["phase"], r["scope"], r["name"], r["n"]) for r in recs if r["step"] == s] for s in (1, 2, 3)]
    assert per_step[0] and per_step[0] == per_step[1] == per_step[2]


class ForeignHook(torch.nn.Module):
    """A hook of someone else's, doubling the gradient, between two modules' hooks on one tensor."""

    def __init__(self, seen):
        super().__init__()
        self.a, self.b, self.seen = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), seen

    def forward(self, x):
        h = self.a(x)
        h.register_hook(lambda g: self.seen.append(g.clone()) or g * 2)
        return self.b(h)


def test_module_backward_sees_the_gradient_other_hooks_leave(tmp_path):
    """Tensor hooks run in registration order, each getting the gradient the previous one left: "a"'s
    output gradient is recorded before the foreign hook doubles it, "b"'s input gradient after."""
    from megatron_bitdet.trace.digest import digest

    torch.manual_seed(0)
    seen = []
    model = ForeignHook(seen)
    with Tracer(tmp_path, 0, 1, level="module") as tr:
        tr.attach(model)
        with tr.step(1):
            model(torch.randn(3, 4)).sum().backward()
    bwd = {r["scope"]: r for r in records(tmp_path)[1] if r["name"] == "backward"}
    assert bwd["a"]["in"] == [digest(seen[0], "fast")]
    assert bwd["b"]["out"] == [digest(seen[0] * 2, "fast")] != bwd["a"]["in"]


def test_inputs_are_fingerprinted_before_inplace_ops(tmp_path):
    x = torch.ones(4)
    with Tracer(tmp_path, 0, 1, level="op", steps=(1, 1)) as tr:
        with tr.step(1):
            x.add_(1.0)
    _, recs = records(tmp_path)
    (rec,) = [r for r in recs if r["name"] == "aten.add_.Tensor"]
    assert rec["in"][0] != rec["out"][0]


def test_tracing_off_installs_nothing(tmp_path):
    model = torch.nn.Linear(2, 2)
    orig = dist.all_reduce
    tr = Tracer(tmp_path, 0, 1, level="op", steps=(5, 6))
    tr.attach(model)
    mod = native.load()
    with tr.step(1):
        assert not model._forward_pre_hooks and not model._forward_hooks
        assert dist.all_reduce is orig and torch._C._len_torch_dispatch_stack() == 0 and not mod.installed()
        model(torch.ones(2))
    with tr.step(5):  # the module hooks as a forward wrapper (nn.Module's fast path, see the next test)
        assert "forward" in vars(model) and dist.all_reduce is not orig and mod.installed()
    assert "forward" not in vars(model) and dist.all_reduce is orig and not mod.installed()
    tr.close()
    _, recs = records(tmp_path)
    assert {r["step"] for r in recs} == {5} or recs == []
    other = Tracer(tmp_path / "other", 3, 4, level="op", ranks={0, 1})
    assert not other.enabled and not (tmp_path / "other").exists()


class Raises(torch.nn.Module):
    def forward(self, x):
        raise ValueError("planted")


@pytest.mark.parametrize("op_tracer", ["native", "python"])
def test_module_hooks_wrap_forward_or_register_with_the_same_records(tmp_path, monkeypatch, op_tracer):
    """A module on nn.Module's fast path gets the tracer's hooks as a forward wrapper (registered hooks
    would send each call through the slow path); one with a hook of its own, or any module while a
    global hook exists, gets them registered. Both write the same records; the wrapper goes with the
    step (an instance ``forward`` it shadowed comes back), and a forward that raises leaves the scope
    as the always-called hook does."""
    if op_tracer == "python":
        monkeypatch.setenv(native.ENV, "python")
    from torch.nn.modules.module import register_module_forward_hook

    def run(run_dir, global_hook):
        torch.manual_seed(0)
        model = torch.nn.Sequential(Block(), Block(), Raises())
        model[1].register_forward_pre_hook(lambda m, args: None)  # a hook of its own: registered
        shadowed = model[0].fc2.forward  # an instance forward, set before the step
        model[0].fc2.forward = shadowed
        handle = register_module_forward_hook(lambda m, args, out: None) if global_hook else None
        try:
            with Tracer(run_dir, 0, 1, level="module") as tr:
                tr.attach(model)
                with tr.step(1):
                    wrapped = {name for name, m in model.named_modules()
                               if vars(m).get("forward", shadowed) is not shadowed}
                    hooked = {name for name, m in model.named_modules() if m._forward_hooks}
                    x = torch.randn(4, 8, requires_grad=True)
                    model[1](model[0](x)).sum().backward()
                    with pytest.raises(ValueError, match="planted"):
                        model[2](x)
                    assert tr.current()[1] == ""
        finally:
            if handle is not None:
                handle.remove()
        assert vars(model[0].fc2)["forward"] is shadowed
        assert not any("forward" in vars(m) for m in (model, model[0], model[1], model[2], model[0].fc1))
        assert not any(m._forward_hooks for m in model.modules())
        return wrapped, hooked, {name for name, _ in model.named_modules()}

    wrapped, hooked, names = run(tmp_path / "wrap", global_hook=False)
    assert hooked == {"1"} and wrapped == names - {"1"}
    assert run(tmp_path / "hooks", global_hook=True) == (set(), names, names)
    a, b = (trace_path(tmp_path / d, 0).read_bytes() for d in ("wrap", "hooks"))
    recs = records(tmp_path / "wrap")[1]
    assert a == b and {"0.fc1", "1.fc2", "2"} <= {r["scope"] for r in recs if r["name"] == "forward"}
    assert {"0.fc1", "1.fc2"} <= {r["scope"] for r in recs if r["name"] == "backward"}


def test_truncated_final_record_is_detected(tmp_path):
    run_model(tmp_path, "semantic")
    path = trace_path(tmp_path, 0)
    path.write_bytes(path.read_bytes()[:-20])
    t = open_trace(path)
    n = sum(1 for _ in t.lines())
    assert t.truncated and n == len(path.read_text().splitlines()) - 2


def _dist_worker(rank, run_dir, rdzv):
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2)
    with Tracer(run_dir, rank, 2, level="op", steps=(1, 1)) as tr:
        with tr.step(1):
            t = torch.arange(4.0) + rank
            dist.all_reduce(t)
            work = dist.all_reduce(t * 2, async_op=True)
            work.wait()
            out = torch.empty(8)
            dist.all_gather_into_tensor(out, t)
            tr.event("after", [t, out])
    dist.destroy_process_group()


def run_dist(run_dir, tmp):
    mp.spawn(_dist_worker, args=(str(run_dir), str(tmp / f"rdzv_{os.path.basename(run_dir)}")), nprocs=2)


def test_two_rank_gloo_traces_align_and_name_peers(tmp_path):
    run_dist(tmp_path / "a", tmp_path)
    run_dist(tmp_path / "b", tmp_path)
    for rank in (0, 1):
        assert trace_path(tmp_path / "a", rank).read_bytes() == trace_path(tmp_path / "b", rank).read_bytes()
        _, recs = records(tmp_path / "a", rank)
        colls = [r for r in recs if r["k"] == "coll"]
        assert [r["name"] for r in colls] == ["all_reduce", "all_reduce", "all_gather_into_tensor"]
        assert all(r["peer"]["group"] == [0, 1] for r in colls)
        assert colls[0]["in"] != colls[0]["out"]  # input hashed before the reduction, output after
        # gloo writes t outside ATen (no version bump): the next op (t * 2) still hashes the reduced bytes
        ops = [r for r in recs if r["k"] == "op"]
        (mul,) = [r for r in ops if r["name"] == "aten.mul.Tensor"]
        (add,) = [r for r in ops if r["name"] == "aten.add.Tensor"]
        assert mul["in"][0] == colls[0]["out"][0] != add["out"][0]
        assert not any(r["name"].startswith("c10d") for r in recs)
    _, r0 = records(tmp_path / "a", 0)
    _, r1 = records(tmp_path / "a", 1)
    assert [r for r in r0 if r["k"] == "coll"][0]["out"] == [r for r in r1 if r["k"] == "coll"][0]["out"]


def _coalesced_worker(rank, run_dir, rdzv, async_ops):
    """megatron's DDP pattern: a reduce-scatter, then an all-gather, each queued in a coalescing block
    (the manager looked up at the call, as megatron's import-time alias is rebound)."""
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2)
    with Tracer(run_dir, rank, 2, level="semantic", steps=(1, 1)) as tr:
        with tr.step(1):
            full, shard, gathered = torch.arange(8.0) + 10 * rank, torch.full((4,), -1.0), torch.zeros(8)
            with dist._coalescing_manager(async_ops=async_ops) as cm:
                dist.reduce_scatter_tensor(shard, full, async_op=async_ops)
            if async_ops:
                cm.wait()
            with dist._coalescing_manager(None, async_ops=async_ops) as cm:
                dist.all_gather_into_tensor(gathered, shard, async_op=async_ops)
            if async_ops:
                cm.wait()
            tr.event("after", [shard, gathered])
    dist.destroy_process_group()


@pytest.mark.parametrize("async_ops", [False, True], ids=["sync", "async"])
def test_coalesced_collectives_are_recorded_once_they_ran(tmp_path, async_ops):
    """Inside ``_coalescing_manager`` c10d only queues a collective and runs the block at its end: the
    record's outputs are hashed then (for an async block at the manager's wait()), never before the
    collective ran, and an async one is recorded although its own Work is never waited on."""
    mp.spawn(_coalesced_worker, args=(str(tmp_path), str(tmp_path / "rdzv"), async_ops), nprocs=2)
    for rank in (0, 1):
        recs = records(tmp_path, rank)[1]
        colls = [r for r in recs if r["k"] == "coll"]
        (after,) = [r for r in recs if r["name"] == "after"]
        assert [r["name"] for r in colls] == ["reduce_scatter_tensor", "all_gather_into_tensor"]
        assert colls[0]["out"] == [after["out"][0]] and colls[1]["out"] == [after["out"][1]]
        assert colls[1]["in"] == [after["out"][0]]  # the all-gather sends the reduced shard


def test_digests_see_writes_that_bypass_aten():
    """Digests are never reused: bytes written behind the dispatcher (numpy, ctypes) after a tensor
    was hashed change its next digest, which equals a fresh copy's."""
    import ctypes

    from megatron_bitdet.trace.digest import digest

    t = torch.arange(64.0)
    first = digest(t, "fast")
    t.numpy()[5] = -1.0
    second = digest(t, "fast")
    assert second != first and second == digest(t.clone(), "fast")
    ctypes.memset(t.data_ptr() + 4 * 63, 0, 4)  # last element zeroed by libc
    assert digest(t, "fast") not in (first, second) and digest(t, "fast") == digest(t.clone(), "fast")
    assert digest(t[8:16], "fast") == digest(t[8:16].clone(), "fast")  # same bytes at another offset


def test_view_digests_are_exact_without_copies():
    from megatron_bitdet.trace.digest import digest

    base = torch.randn(6, 4)
    bumped = base.clone()
    bumped[5, 3] += 1
    assert digest(base.t(), "fast") == digest(base.clone().t(), "fast")
    assert digest(base.t(), "fast") != digest(bumped.t(), "fast")  # transposed: hashed in memory order
    col = torch.randn(4, 1)
    col2 = col.clone()
    col2[3] = -col2[3]
    assert digest(col.expand(4, 100), "fast") != digest(col2.expand(4, 100), "fast")  # broadcast: once
    assert digest(base[:, :2], "fast") != digest(bumped[:, 1:3], "fast")  # strided slice: copied
    assert digest(base[:, 3], "fast") != digest(bumped[:, 3], "fast")


def _aliasing_program():
    """Ops whose outputs alias inputs in every way a shortcut could get wrong: views of the same and
    of other spans, dtype views, conj / neg bits, writes through views, a numpy write between ops."""
    torch.manual_seed(3)
    w = torch.nn.Parameter(torch.randn(6, 4))
    x = torch.randn(5, 6)
    h = x @ w
    h.view(-1).view(torch.int32).sum()
    h.t().reshape(-1)              # transposed: reshape copies, then _unsafe_view of the copy
    h.detach().unsqueeze(0).squeeze(0)[1:].add_(1.0)  # written through a chain of views
    h.detach().numpy()[0, 0] = 7.0  # behind the dispatcher: the next op must read the new bytes
    (h.view(20) * 2).split(5)
    c = torch.randn(3, 2, dtype=torch.complex64)
    torch.view_as_real(c.conj().resolve_conj()).sum()
    c.conj().imag.view(-1).abs()   # a neg-bit float view
    (x @ w).square().sum().backward()
    torch.optim.Adam([w], lr=0.1, foreach=True).step()
    return (w.expand(2, 6, 4) * 1.0).sum()


class _HashEverything(torch.utils._python_dispatch.TorchDispatchMode):
    """The reference: every op's inputs before and outputs after, each hashed in full."""

    def __init__(self):
        super().__init__()
        self.records = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from megatron_bitdet.trace.digest import digest, trace_tensors

        kwargs = kwargs or {}
        if func.namespace == "profiler":  # not an op on data (the optimizer's record_function)
            return func(*args, **kwargs)
        ins = [digest(t, "fast") for t in trace_tensors((args, kwargs))]
        out = func(*args, **kwargs)
        outs = [digest(t, "fast") for t in trace_tensors(out)]
        if not str(func).startswith("aten.empty"):
            self.records.append((str(func), ins, outs))
        return out


def test_native_op_tracer_is_built_here(tmp_path):
    """A CPU machine with a compiler traces ops natively: a failed build must fail here, not leave every
    other test silently on the Python dispatch mode."""
    assert native.load() is not None, native.why()
    with Tracer(tmp_path, 0, 1, level="op") as tr:
        assert tr.op_tracer == "native"
    assert open_trace(trace_path(tmp_path, 0)).header["op_tracer"] == "native"


def test_native_digests_equal_python_digests():
    from megatron_bitdet.trace.digest import digest

    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, 4, generator=g)
    c = torch.randn(3, dtype=torch.complex64, generator=g)
    cases = [base, base.transpose(0, 2), base.permute(1, 2, 0), base[:, 1:3], base[::2], base[:, :1].expand(6, 7, 4),
             torch.randn(3, generator=g).expand(4, 3), torch.tensor(3.5), torch.empty(0, 3), torch.rand(5) > 0.5,
             base.bfloat16(), torch.arange(10), c.conj(), c.conj().imag, torch.randn(1, 4).t(), base[:, 2, :],
             torch.randn(4, 4).diagonal(), torch.randn(8).to(torch.float8_e4m3fn), torch.arange(12).view(3, 4).t()]
    mod = native.load()
    got = [mod.digest(t) for t in cases]
    assert got == [digest(t, "fast") for t in cases] and len(set(got)) == len(cases)


@pytest.mark.parametrize("op_tracer", ["native", "python"])
def test_op_records_equal_hashing_every_tensor_in_full(tmp_path, monkeypatch, op_tracer):
    """Each tracer's shortcuts (cached byte spans, a view's output hex taken from the input it aliases)
    write exactly what hashing every input and output in full writes. The reference is a Python
    dispatch mode; on this program the native tracer's stream differs from a mode's only in
    ``aten.detach`` records (the Parameter's creation, autograd's detach of a non-differentiable view),
    which that comparison leaves out."""
    if op_tracer == "python":
        monkeypatch.setenv(native.ENV, "python")
    with _HashEverything() as ref:
        _aliasing_program()
    with Tracer(tmp_path, 0, 1, level="op") as tr:
        assert tr.op_tracer == op_tracer
        with tr.step(1):
            _aliasing_program()
    skip = ("aten.empty",) + (("aten.detach",) if op_tracer == "native" else ())
    got = [(r["name"], r["in"], r["out"]) for r in records(tmp_path)[1] if not r["name"].startswith(skip)]
    assert len(got) > 40 and got == [(n, i, o) for n, i, o in ref.records if not n.startswith(skip)]
    assert any(n == "aten.view.default" for n, _, _ in got) and any(n == "aten._unsafe_view.default" for n, _, _ in got)
    lines = trace_path(tmp_path, 0).read_text().splitlines()[1:]
    # each line is built from cached pieces without json.dumps: it must be exactly json.dumps's output
    assert lines == [json.dumps(json.loads(x), separators=(",", ":")) for x in lines]
    assert any(":s" in x for x in lines)  # layout tags among them
