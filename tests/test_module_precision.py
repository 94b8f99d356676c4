"""Module tests in the brief's style: a hybrid block (Mamba-2, attention, MoE) repeated with restored
RNG under TP2 (+SP), EP2 and PP2, in fp32, bf16, emulated FP8 (delayed scaling, bf16 params) and
emulated NVFP4 (NVIDIA's recipe: stochastic rounding, Hadamard transform, 2D weight blocks; bf16
params); outputs and every gradient compared byte for byte. Dropout is on, so the repeat only matches
when the RNG really is restored: a third run that does not restore it must differ (the check can fail).
NVFP4 also runs once with everything restored except its rounding generators: its forward is the
same and its gradients differ, so the difference is stochastic rounding's.
One 2-rank launch builds every layout (one after another, megatron's parallel state rebuilt between)
and all three precisions on each."""
import os
from pathlib import Path

import pytest
import torch

from megatron_bitdet.recipe import load_recipe
from megatron_bitdet.train.launch import launch

ROOT = Path(__file__).resolve().parents[1]
TESTS = str(Path(__file__).parent)
BLOCK = ["model.hybrid_pattern=M*ME", "model.seq_length=32", "model.hidden_dropout=0.1",
         "model.attention_dropout=0.1", "training.micro_batch_size=2", "training.global_batch_size=2",
         "parallel.distributed_optimizer=false", "parallel.expert=1"]
LAYOUTS = {
    "tp2": ["parallel.tensor=2", "parallel.sequence_parallel=true"],
    "ep2": ["parallel.expert=2", "training.global_batch_size=4"],
    "pp2": ["parallel.pipeline=2"],
}
PRECISIONS = {
    "fp32": [],
    "bf16": ["model.params_dtype=bfloat16"],
    "fp8": ["model.params_dtype=bfloat16", "model.fp8.recipe=delayed"],
    "fp4": ["model.params_dtype=bfloat16", "model.fp4.recipe=nvfp4"],
}
PARAM_DTYPE = {"fp32": ["torch.float32"], "bf16": ["torch.bfloat16"], "fp8": ["torch.bfloat16"],
               "fp4": ["torch.bfloat16"]}

pytestmark = pytest.mark.timeout(900)


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def block_results(tmp_path_factory):
    """Rank -> layout -> precision -> results, from one launch."""
    out = tmp_path_factory.mktemp("block")
    recipe = str(ROOT / "recipes" / "nemotron_h_tiny.yaml")
    layouts = {layout: {p: load_recipe(recipe, [*BLOCK, *LAYOUTS[layout], *o]).to_dict() for p, o in PRECISIONS.items()}
               for layout in LAYOUTS}
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    rc = launch("precision_workers:hybrid_block", 2,
                {"recipe": layouts["tp2"]["fp32"], "layouts": layouts, "out": str(out)}, run_dir=out / "run", env=env)
    assert rc == 0, (out / "run").as_posix()
    return [torch.load(out / f"rank_{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_block_repeats_bitwise(block_results, layout, precision):
    for rank, results in enumerate(block_results):
        res = results[layout][precision]
        assert res["dtypes"] == PARAM_DTYPE[precision]
        assert (res["fp8_linears"] > 0) == (precision == "fp8")
        assert (res["fp4_linears"] > 0) == (precision == "fp4")
        (out1, grads1), (out2, grads2), (out3, _) = res["first"], res["again"], res["fresh"]
        assert out1 and len(out1) == len(out2), f"{layout} rank {rank}: no outputs captured"
        for a, b in zip(out1, out2):
            assert a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b), (layout, rank, precision)
        assert len(grads1) > 5 and grads1.keys() == grads2.keys()
        differ = [k for k in grads1 if _bits(grads1[k]) != _bits(grads2[k])]
        assert differ == [], f"{layout} rank {rank} {precision}: gradients differ: {differ[:5]}"
        assert any(g.abs().sum() > 0 for g in grads1.values())
        # Without restoring the RNG, dropout masks are new: the comparison sees it.
        assert any(_bits(a) != _bits(c) for a, c in zip(out1, out3)), (layout, rank, precision)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp4_difference_without_restore_is_stochastic_rounding(block_results, layout):
    """Everything restored but the NVFP4 layers' rounding generators: the forward (which rounds to
    nearest) is byte-identical, the gradients are not."""
    for rank, results in enumerate(block_results):
        res = results[layout]["fp4"]
        assert res["generators"] and all(g.endswith(":fp4_sr_generator") for g in res["generators"])
        (out1, grads1), (out4, grads4) = res["first"], res["sr_only"]
        assert [_bits(a) for a in out1] == [_bits(b) for b in out4], (layout, rank)
        assert any(_bits(grads1[k]) != _bits(grads4[k]) for k in grads1), (layout, rank)
        assert all(results[layout][p]["sr_only"] is None for p in ("fp32", "bf16", "fp8"))
