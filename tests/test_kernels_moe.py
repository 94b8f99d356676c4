"""Deterministic MoE kernels against megatron-core's own implementations, on real torch/gloo.

Tolerances (two different summation orders of the same float32 values):
* aux loss forward: rtol 1e-5 (megatron's ``probs.sum(0)`` vs our block/tree order over <= 4k tokens);
* grouped MLP: outputs, input and weight grads bitwise equal to ``SequentialMLP``'s; dprob (tree over
  N-tiles vs torch's reduction) with atol 1e-6. Bitwise claims (repeats, thread counts, rank order,
  the aux-loss backward, which has no reduction) use ``torch.equal`` on the bits.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_bitdet.compat import cpu_backend
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.kernels.grouped_mlp import GroupedMLPConfig, GroupedProbMLP, dprob_slots, grouped_prob_mlp
from megatron_bitdet.kernels.moe_aux import (
    AuxLossConfig,
    block_partials,
    fixed_order_aux_loss,
    rank_ordered_sum,
    switch_load_balancing_loss_func,
    tree_sum,
)

cpu_backend.install()

from megatron.core.activations import squared_relu  # noqa: E402  (after the CPU seams)
from megatron.core.transformer.moe import moe_utils  # noqa: E402


def _bits(t: torch.Tensor) -> str:
    return t.detach().contiguous().numpy().tobytes().hex()


# --------------------------------------------------------------------------- fixed-order sums


def _tree_reference(values):
    """The documented tree, element by element in float32 (numpy-free, struct-rounded)."""
    f32 = lambda v: struct.unpack("f", struct.pack("f", v))[0]  # noqa: E731
    vals = list(values)
    while len(vals) > 1:
        h = len(vals) // 2
        nxt = [f32(vals[i] + vals[i + h]) for i in range(h)]
        if len(vals) % 2:
            nxt[-1] = f32(nxt[-1] + vals[2 * h])
        vals = nxt
    return vals[0]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 101])
def test_tree_sum_follows_the_documented_order(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    assert tree_sum(x).item() == _tree_reference(x.tolist())
    cols = torch.randn(5, n, generator=torch.Generator().manual_seed(n + 1))
    along_last = tree_sum(cols, dim=1)  # folds in place along the innermost dim
    assert along_last.tolist() == [_tree_reference(r.tolist()) for r in cols]
    assert torch.equal(along_last, tree_sum(cols.t().contiguous(), dim=0))  # the front-moved path
    assert torch.equal(along_last, torch.stack([tree_sum(r) for r in cols]))


def _router_inputs(tokens, experts=8, topk=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(tokens, experts, generator=g), dim=-1)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, probs.topk(topk, dim=1).indices, True)
    return probs, routing_map.sum(dim=0)


@pytest.mark.parametrize("tokens", [1, 255, 256, 1000, 4096])
@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_matches_megatron_unfused(tokens, masked):
    probs, counts = _router_inputs(tokens)
    mask = (torch.arange(tokens) % 5 != 0) if masked else None
    total = counts.sum() / 2 if masked else tokens  # megatron passes a tensor with a padding mask
    args = (counts, total, 2, 8, 1e-2)
    ours_p, ref_p = probs.clone().requires_grad_(), probs.clone().requires_grad_()
    ours = switch_load_balancing_loss_func(ours_p, *args, padding_mask=mask)
    ref = moe_utils.switch_load_balancing_loss_func(ref_p, *args, padding_mask=mask)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=0)
    ours.backward()
    ref.backward()
    assert torch.equal(ours_p.grad, ref_p.grad)  # same formula, no reduction: bitwise


def test_aux_loss_is_bitwise_repeatable_and_thread_independent():
    probs, counts = _router_inputs(3001, experts=64, seed=3)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 1, 2):  # not the machine's default, which may be 1
            torch.set_num_threads(n)
            results.append(_bits(fixed_order_aux_loss(probs, counts, 0.25, AuxLossConfig(block_rows=128))))
    finally:
        torch.set_num_threads(threads)
    assert len(set(results)) == 1


def test_block_size_is_part_of_the_order():
    """The slot size changes the tree, so the bits of the per-expert sums (it belongs in the recipe): a
    kernel ignoring block_rows would give equal bits. The loss itself (~3e5 here) usually rounds those
    last-bit differences away, so the sums are compared. Not the value beyond rounding (two summation
    orders: rtol)."""
    probs, counts = _router_inputs(3001, experts=64, seed=5)
    a, b = (tree_sum(block_partials(probs, rows), dim=0) for rows in (64, 1024))
    assert _bits(a) != _bits(b)
    assert _bits(a) == _bits(tree_sum(block_partials(probs, 64), dim=0))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    la, lb = (fixed_order_aux_loss(probs, counts, 1.0, AuxLossConfig(block_rows=rows)) for rows in (64, 1024))
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=0)


# --------------------------------------------------------------------------- cross-rank (2 real gloo ranks)

TOKENS, EXPERTS, TOPK, COEFF = 300, 8, 2, 1e-2


def _aux_worker(rank, rdzv, out):
    cpu_backend.install()
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2)
    from megatron.core import parallel_state

    from megatron_bitdet.compat.patching import load_declarations, patched

    parallel_state.initialize_model_parallel()  # TP1 PP1: DP over the 2 ranks
    probs, local_counts = _router_inputs(TOKENS, EXPERTS, TOPK, seed=100 + rank)
    global_counts = local_counts.clone()
    dist.all_reduce(global_counts)  # integer counts: all_reduce is exact
    loss = switch_load_balancing_loss_func(probs, global_counts, 2 * TOKENS, TOPK, EXPERTS, COEFF)
    summed_all_reduce = loss.clone()
    dist.all_reduce(summed_all_reduce)
    result = {
        "loss": _bits(loss),
        "world": _bits(rank_ordered_sum(loss)),
        "new_group": _bits(rank_ordered_sum(loss, dist.new_group([0, 1]))),
        "all_reduce": summed_all_reduce.item(),
    }
    with patched(load_declarations(ids=["moe_aux_loss"])):  # megatron's own tracker path, patched
        moe_utils.save_to_aux_losses_tracker(
            "load_balancing_loss", loss, 1, 1, reduce_group=parallel_state.get_tensor_and_context_parallel_group()
        )
        totals = {}
        moe_utils.track_moe_metrics(loss_scale=1.0, iteration=1, total_loss_dict=totals, num_layers=1)
    result["tracked"] = _bits(totals["load_balancing_loss"])
    Path(out, f"rank_{rank}.json").write_text(json.dumps(result))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_cross_rank_sums_are_rank_ordered_on_a_real_gloo_group(tmp_path):
    torch.multiprocessing.spawn(_aux_worker, args=(str(tmp_path / "rdzv"), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    # the same computation in one process, no group: per-rank losses, added in rank order
    (p0, c0), (p1, c1) = (_router_inputs(TOKENS, EXPERTS, TOPK, seed=100 + r) for r in range(2))
    losses = [switch_load_balancing_loss_func(p, c0 + c1, 2 * TOKENS, TOPK, EXPERTS, COEFF) for p in (p0, p1)]
    assert [r["loss"] for r in ranks] == [_bits(l) for l in losses]
    expected = losses[0] + losses[1]
    for r in ranks:
        assert r["world"] == r["new_group"] == _bits(expected)  # independent of the group construction
        assert r["all_reduce"] == pytest.approx(expected.item(), rel=1e-6)  # a different algorithm
        # tracker: [0 + loss] per rank, PP/TP sums of one rank, DP average, then megatron's * scale, sum / layers
        tracked = ((torch.zeros(1) + losses[0]) + (torch.zeros(1) + losses[1])) / 2
        assert r["tracked"] == _bits((tracked.float() * 1.0).sum() / 1)


# --------------------------------------------------------------------------- grouped expert MLP


@pytest.fixture(scope="module")
def megatron_1rank(tmp_path_factory):
    """A 1-rank gloo world with megatron's parallel state (torn down after the module)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    owns = not dist.is_initialized()
    if owns:
        store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    yield parallel_state
    parallel_state.destroy_model_parallel()
    if owns:
        dist.destroy_process_group()


def moe_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=96, moe_ffn_hidden_size=96,
        num_moe_experts=4, moe_router_topk=2, add_bias_linear=False, use_cpu_initialization=True,
        activation_func=squared_relu, bias_activation_fusion=False, gradient_accumulation_fusion=False,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
    )
    base.update(overrides)
    return TransformerConfig(**base)


def _experts(cls, config):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return cls(config.num_moe_experts, config, sub, ProcessGroupCollection.use_mpu_process_groups())


def _run(module, x, counts, probs):
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, bias = module(x, counts, probs)
    out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).reshape(out.shape))
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return out.detach(), bias, x.grad, probs.grad, grads


ACTIVATIONS = {
    "squared_relu": dict(activation_func=squared_relu),
    "gelu": dict(activation_func=F.gelu),
    "swiglu": dict(activation_func=F.silu, gated_linear_unit=True),
}


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_grouped_mlp_matches_sequential_mlp(megatron_1rank, act):
    from megatron.core.transformer.moe.experts import SequentialMLP

    config = moe_config(**ACTIVATIONS[act])
    ref, ours = _experts(SequentialMLP, config), _experts(GroupedProbMLP, config)
    ours.load_state_dict(ref.state_dict())  # same layout: SequentialMLP's weights and keys
    counts = torch.tensor([7, 0, 13, 5])  # an empty expert included
    g = torch.Generator().manual_seed(7)
    x, probs = torch.randn(25, 32, generator=g), torch.rand(25, generator=g)
    r_out, _, r_dx, r_dp, r_grads = _run(ref, x, counts, probs)
    o_out, o_bias, o_dx, o_dp, o_grads = _run(ours, x, counts, probs)
    assert o_bias is None
    assert _bits(o_out) == _bits(r_out) and _bits(o_dx) == _bits(r_dx)  # same GEMMs, same order: bitwise
    assert [_bits(a) for a in o_grads] == [_bits(b) for b in r_grads]
    # dprob: the private-slot tree over N-tiles vs torch's reduction, two different orders (atol)
    torch.testing.assert_close(o_dp, r_dp, atol=1e-6, rtol=0)
    again = _run(ours, x, counts, probs)  # bitwise repeatable
    assert all(torch.equal(a, b) for a, b in zip([o_out, o_dx, o_dp, *o_grads], [again[0], again[2], again[3], *again[4]]))


def test_moe_layer_runs_with_grouped_experts_like_sequential(megatron_1rank):
    """megatron's MoELayer (router, alltoall dispatcher) with GroupedProbMLP as its experts, its kernel config
    passed through the experts builder (a ModuleSpec's params, or a 0.17+ partial's keywords) as
    model.builder passes a recipe's grouped backend."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron_bitdet.compat import builders

    config = moe_config()
    spec = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=4)
    ref = spec(config=config, layer_number=1)  # a ModuleSpec before megatron-core 0.17, a partial from 0.17
    moe = builders.submodules_of(spec)
    moe.experts = builders.rebuilt(moe.experts, module=GroupedProbMLP, kernel_config=GroupedMLPConfig(dprob_tile_n=16))
    ours = spec(config=config, layer_number=1)
    assert ours.experts.kernel_config == GroupedMLPConfig(dprob_tile_n=16)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(1))
    outs = []
    for layer in (ref, ours):
        xi = x.clone().requires_grad_()
        out, _ = layer(xi)
        out.square().sum().backward()
        outs.append((out.detach(), xi.grad, layer.router.weight.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_dprob_uses_one_private_slot_per_n_tile():
    g = torch.Generator().manual_seed(2)
    ds, act = torch.randn(9, 200, generator=g), torch.rand(9, 200, generator=g)
    slots = dprob_slots(ds, act, 64)
    assert slots.shape == (9, 4)  # ceil(200 / 64) tiles, the last one zero-padded
    for j in range(4):
        assert torch.equal(slots[:, j], tree_sum(F.pad(ds * act, (0, 56))[:, 64 * j : 64 * (j + 1)], dim=1))
    torch.testing.assert_close(tree_sum(slots, dim=1), (ds * act).sum(1), atol=1e-5, rtol=0)


def test_grouped_mlp_config_is_validated(megatron_1rank):
    with pytest.raises(BitdetInputError, match="power of two"):
        GroupedMLPConfig(dprob_tile_n=48)
    with pytest.raises(BitdetInputError, match="backend"):
        GroupedMLPConfig(backend="cutlass")
    with pytest.raises(BitdetInputError, match="add_bias_linear"):
        _experts(GroupedProbMLP, moe_config(add_bias_linear=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton grouped MLP needs a CUDA device (and the triton package)")
def test_triton_grouped_mlp_private_slots_are_repeatable_and_match_torch():
    pytest.importorskip("triton")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    counts = torch.tensor([300, 0, 777, 64, 1], device=dev)
    x = torch.randn(int(counts.sum()), 256, device=dev, generator=g)
    probs = torch.rand(x.shape[0], device=dev, generator=g)
    w1 = torch.randn(5, 512, 256, device=dev, generator=g) / 16
    w2 = torch.randn(5, 256, 512, device=dev, generator=g) / 22

    def run(backend, device=dev):  # the torch reference on CPU: another device's GEMMs (gpu_check times CUDA's)
        leaves = [t.to(device).clone().requires_grad_() for t in (x, probs, w1, w2)]
        y = grouped_prob_mlp(*leaves[:2], *leaves[2:], counts.to(device), squared_relu, GroupedMLPConfig(backend=backend))
        y.backward(torch.ones_like(y))
        return [t.to(dev) for t in [y.detach()] + [t.grad for t in leaves]]

    ref, slots, slots_again = run("torch", torch.device("cpu")), run("triton"), run("triton")
    atomic = run("triton_atomic")
    assert all(torch.equal(a, b) for a, b in zip(slots, slots_again))
    for a, b, c in zip(slots, ref, atomic):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(c, b, atol=1e-3, rtol=1e-3)
