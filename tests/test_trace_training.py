"""Tracing inside real 2-rank megatron training (gloo): aligned twins, scope names, phases, events,
manifest, and nothing installed outside the trace window (observed from inside the model)."""
import json
import os
from pathlib import Path

import pytest
import torch

from megatron_bitdet.analysis.localize import localize_traces
from megatron_bitdet.cli import main
from megatron_bitdet.recipe import load_recipe
from megatron_bitdet.trace import TraceConfig, native
from megatron_bitdet.train.run import RunOptions, launch_training

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "nemotron_h_tiny.yaml"
PROBE_ENV = "BITDET_TEST_PROBE_DIR"
TRACE = {"level": "module", "steps": [2, 2], "ranks": None, "hash": "fast"}
_ALL_REDUCE = torch.distributed.all_reduce  # imported by the rank before any tracing


class _Probe(torch.nn.Module):
    """Wraps the final norm; at every forward it writes what tracing has installed right now."""

    def __init__(self, inner, root):
        super().__init__()
        self.inner = inner
        self._root = [root]  # a list: not a submodule

    def forward(self, x):
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        mods = list(self._root[0].modules())
        seen = {
            # the tracer's module hooks: registered, or a forward wrapper (an instance ``forward``)
            "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
                         + ("forward" in vars(m)) for m in mods),
            "global_hooks": len(torch.nn.modules.module._global_forward_hooks),
            "dispatch_modes": len(_get_current_dispatch_mode_stack()),
            "all_reduce_wrapped": torch.distributed.all_reduce is not _ALL_REDUCE,
        }
        path = Path(os.environ[PROBE_ENV]) / f"rank_{torch.distributed.get_rank()}.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps(seen) + "\n")
        return self.inner(x)


def probe_provider(recipe, config, *, pre_process=True, post_process=True):
    from megatron_bitdet.model.builder import default_model_provider

    model = default_model_provider(recipe, config, pre_process=pre_process, post_process=post_process)
    if post_process:
        model.decoder.final_norm = _Probe(model.decoder.final_norm, model)
    return model


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """Two identical runs, module-level tracing in step 2 of 3, with the probe; a third one beside them
    (``python``) with the Python module hooks instead of the native tracer's."""
    base = tmp_path_factory.mktemp("twins")
    recipe = load_recipe(RECIPE, ["training.iterations=3"])
    runs, saved = [], dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    for name in ("a", "b", "python"):
        probe = base / f"probe_{name}"
        probe.mkdir()
        os.environ[PROBE_ENV] = str(probe)
        if name == "python":
            os.environ[native.ENV] = "python"
        try:
            rc = launch_training(recipe, RunOptions(nproc=2, run_dir=base / name,
                                                    model_provider="tests.test_trace_training:probe_provider",
                                                    trace=TraceConfig.from_json(TRACE)))
        finally:
            os.environ.clear()
            os.environ.update(saved)
        assert rc == 0
        runs.append(base / name)
    return runs[:2]


def _records(run, rank):
    lines = (run / "traces" / f"rank_{rank:05d}.trace.jsonl").read_text().splitlines()
    return json.loads(lines[0]), [json.loads(x) for x in lines[1:]]


@pytest.mark.timeout(240)
def test_twins_align_and_localize_exits_0(twins, capsys):
    result = localize_traces(*twins)
    assert not result.mismatch and result.events_compared > 100
    assert main(["localize", str(twins[0]), str(twins[1])]) == 0
    assert "no mismatch" in capsys.readouterr().out


@pytest.mark.timeout(240)
def test_native_and_python_module_hooks_write_the_same_records(twins):
    """The C++ hooks are the Python hooks' logic: the same records, byte for byte, on every rank."""
    assert native.load() is not None, native.why()
    for rank in (0, 1):
        lines = [(run / "traces" / f"rank_{rank:05d}.trace.jsonl").read_bytes().splitlines()[1:]
                 for run in (twins[0], twins[0].parent / "python")]
        assert len(lines[0]) > 300 and lines[0] == lines[1]


@pytest.mark.timeout(240)
def test_scopes_phases_events_and_manifest(twins):
    header, recs = _records(twins[0], 0)
    assert header["level"] == "module" and header["steps"] == [2, 2]
    assert {r["step"] for r in recs} == {2}
    scopes = {r["scope"] for r in recs}
    assert "decoder.layers.2.mlp.experts" in scopes          # megatron's module paths, DDP unwrapped
    assert not any(s.startswith("module.") for s in scopes)
    assert {r["phase"] for r in recs} >= {"forward", "backward", "grad_reduce", "optimizer"}
    names = {(r["phase"], r["name"]) for r in recs if r["k"] == "event"}
    assert ("grad_reduce", "grad_buffers") in names and ("optimizer", "optimizer.step") in names
    opt = next(r for r in recs if r["name"] == "optimizer.step")
    assert len(opt["out"]) > len(opt["in"]) // 2  # params after + optimizer state
    manifest = json.loads((twins[0] / "manifest.json").read_text())
    assert manifest["trace"] == TRACE


@pytest.mark.timeout(240)
def test_nothing_installed_outside_the_window(twins):
    for run in twins:
        probe = run.parent / f"probe_{run.name}"
        for rank in (0, 1):
            seen = [json.loads(x) for x in (probe / f"rank_{rank}.jsonl").read_text().splitlines()]
            per_step = len(seen) // 3  # micro-batches per step on this rank
            outside = seen[:per_step] + seen[2 * per_step:]
            inside = seen[per_step:2 * per_step]
            assert outside and all(s == {"hooks": 0, "global_hooks": 0, "dispatch_modes": 0,
                                         "all_reduce_wrapped": False} for s in outside)
            assert all(s["hooks"] > 0 and s["all_reduce_wrapped"] for s in inside)  # the probe can see them


def test_bad_trace_arguments_exit_2(tmp_path, capsys):
    base = ["train", "--recipe", str(RECIPE), "--run-dir", str(tmp_path / "x")]
    assert main(base + ["--trace", "ops"]) == 2
    assert main(base + ["--trace", "op", "--trace-steps", "4-2"]) == 2
    assert main(base + ["--trace-steps", "1-2"]) == 2
    err = capsys.readouterr().err
    assert "trace level 'ops'" in err and "need 1 <= A <= B" in err and "need --trace LEVEL" in err
    assert not (tmp_path / "x").exists()
