"""The regression helpers users get from the pytest plugin (fixtures requested here without any
conftest: the pytest11 entry point of the installed package provides them). Each must fail on a planted
source of nondeterminism of examples/planted_nondeterminism.py — megatron's deterministic-mode embedding
lookup whose index_put_(accumulate)-style backward sums in thread order on 2 threads without torch's
deterministic algorithms (planted: the real kernel's race need not happen on a given CPU and check), and the
order-dependent sum that varies on one thread too — and pass on every kernel the patch declarations swap in."""
from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch

from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.compat.patching import load_declarations, split_symbol
from megatron_bitdet.testing import Layout, NondeterminismError

REPO = Path(__file__).resolve().parents[1]
GEN_SEED = 7


def _randn(*shape, gen, dtype=torch.float32, grad=True):
    return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(grad)


def gather_rows(weight, ids):
    """megatron's deterministic-mode embedding lookup (weight[ids]) with the planted thread-ordered backward."""
    from examples.planted_nondeterminism import thread_order_gather

    return thread_order_gather(weight, ids)


def _gather_inputs():
    gen = torch.Generator().manual_seed(GEN_SEED)
    return _randn(64, 64, gen=gen), torch.randint(0, 64, (8192,), generator=gen)  # every row repeated ~128x


# ---------------------------------------------------------------------------- kernel check


def test_kernel_check_fails_on_a_thread_ordered_backward_and_names_the_element(bitdet_kernel_check, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    with pytest.raises(NondeterminismError) as info:
        bitdet_kernel_check(gather_rows, *_gather_inputs(), threads=(1, 2), repeats=5,
                            deterministic_algorithms=False)
    text = str(info.value)
    assert "check_kernel(gather_rows) is not bitwise repeatable" in text
    assert "threads=2: repeat" in text and "threads=1: repeat" not in text
    assert "grad of input[0]:" in text and "output" not in text.split("why:")[0]  # the forward is a gather
    assert "first at [" in text and "float32:" in text and "(torch.float32, shape (64, 64))" in text
    assert "repeatable on 1 thread, not on [2]" in text and "only gradients differ" in text
    assert "deterministic algorithms were off" in text
    assert [d.name for d in info.value.differences] == ["grad of input[0]"]
    # the fix the message names: torch's deterministic algorithms (the planted sum then runs in index order)
    report = bitdet_kernel_check(gather_rows, *_gather_inputs(), threads=(1, 2), repeats=5)
    assert report.tensors == ["output", "grad of input[0]"] and report.settings == ["threads=1", "threads=2"]


def test_kernel_check_fails_on_the_planted_order_dependent_sum(bitdet_kernel_check, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from examples.planted_nondeterminism import atomic_sum

    partials = _randn(8, 4096, gen=torch.Generator().manual_seed(GEN_SEED))
    with pytest.raises(NondeterminismError) as info:
        bitdet_kernel_check(atomic_sum, partials, threads=(1,), repeats=5, name="atomic_sum")
    text = str(info.value)
    assert "check_kernel(atomic_sum)" in text and "threads=1: repeat 1 of 5" in text
    assert "output:" in text and "differs on a single thread" in text and "os.urandom" in text
    assert "grad of input[0]" not in text  # its backward (an expand) is exact


def test_kernel_check_compares_every_gradient_and_refuses_what_proves_nothing(bitdet_kernel_check):
    gen = torch.Generator().manual_seed(GEN_SEED)
    lin = torch.nn.Linear(16, 8)
    report = bitdet_kernel_check(lin, _randn(4, 16, gen=gen), repeats=2, threads=(2,))
    assert report.tensors == ["output", "grad of input[0]", "grad of parameter weight", "grad of parameter bias"]
    # RNG is restored before every repeat: dropout draws the same mask each time
    assert bitdet_kernel_check(torch.nn.functional.dropout, _randn(64, gen=gen), p=0.5).repeats == 5
    with pytest.raises(ValueError, match="repeats must be >= 2"):
        bitdet_kernel_check(lin, _randn(4, 16, gen=gen), repeats=1)
    with pytest.raises(TypeError, match="nothing to compare"):
        bitdet_kernel_check(lambda x: None, _randn(4, gen=gen))


def _transformer_config(**kwargs):
    return Layout().transformer_config(num_layers=1, hidden_size=32, num_attention_heads=4, **kwargs)


def _kernel_cases():
    """Replacement symbol -> (callable, args, kwargs) for the kernel check, in-process."""
    from megatron_bitdet.kernels.causal_conv1d import causal_conv1d_fn, ssd_split_conv1d_scan_combined
    from megatron_bitdet.kernels.gated_rmsnorm import GatedRMSNorm
    from megatron_bitdet.kernels.moe_aux import switch_load_balancing_loss_func
    from megatron_bitdet.kernels.ssd import ssd_chunk_scan_combined
    from megatron_bitdet.model.norm import LocalNorm

    gen = torch.Generator().manual_seed(GEN_SEED)
    r = lambda *s, grad=True: _randn(*s, gen=gen, grad=grad)  # noqa: E731
    b, l, h, p, g, n = 2, 50, 4, 8, 2, 16
    dim, conv_dim = h * p, h * p + 2 * g * n
    probs = torch.softmax(r(512, 8, grad=False), dim=-1).requires_grad_()
    counts = torch.zeros(512, 8, dtype=torch.bool).scatter(1, probs.topk(2, dim=1).indices, True).sum(0)
    A = (-torch.rand(h, generator=gen) - 0.1).requires_grad_()
    return {
        "megatron_bitdet.kernels.causal_conv1d:causal_conv1d_fn": (
            causal_conv1d_fn, (r(2, 64, 300), r(64, 4), r(64)), dict(activation="silu")),
        "megatron_bitdet.kernels.causal_conv1d:ssd_split_conv1d_scan_combined": (
            ssd_split_conv1d_scan_combined, (r(b, l, 2 * dim + 2 * g * n + h), r(conv_dim, 4), r(conv_dim), r(h), A,
                                             r(h), 16), dict(headdim=p, ngroups=g, return_final_states=True)),
        "megatron_bitdet.kernels.ssd:ssd_chunk_scan_combined": (
            ssd_chunk_scan_combined, (r(b, l, h, p), r(b, l, h), A, r(b, l, g, n), r(b, l, g, n), 16),
            dict(D=r(h), z=r(b, l, h, p), dt_bias=r(h), dt_softplus=True, initial_states=r(b, h, p, n),
                 return_final_states=True)),
        "megatron_bitdet.kernels.gated_rmsnorm:GatedRMSNorm": (
            GatedRMSNorm(64, group_size=32, norm_before_gate=False), (r(4, 50, 64), r(4, 50, 64)), {}),
        "megatron_bitdet.kernels.moe_aux:switch_load_balancing_loss_func": (
            switch_load_balancing_loss_func, (probs, counts, 512, 2, 8, 1e-2), {}),
        "megatron_bitdet.model.norm:LocalNorm": (
            LocalNorm(_transformer_config(normalization="RMSNorm"), 64), (r(4, 50, 64),), {}),
    }


# swapped in under megatron's parallel state on several ranks: covered by the module check below
MODULE_CASES = {"megatron_bitdet.kernels.grouped_mlp:GroupedProbMLP",
                "megatron_bitdet.kernels.moe_aux:reduce_aux_losses_tracker_across_ranks",
                "megatron_bitdet.kernels.moe_aux:sync_metrics",
                "megatron_bitdet.kernels.moe_aux:switch_load_balancing_loss_func",
                "megatron_bitdet.model.norm:LocalNorm"}
# the emulated FP8 / NVFP4 linears need megatron's TP state and an fp8 / fp4 TransformerConfig: their
# bitwise repeats (outputs and every gradient, TP2 / EP2 / PP2) are tests/test_module_precision.py's fp8
# and fp4 columns
MODULE_PRECISION_CASES = {"megatron_bitdet.kernels.fp8_linear:EmulatedFP8ColumnParallelLinear",
                          "megatron_bitdet.kernels.fp8_linear:EmulatedFP8RowParallelLinear",
                          "megatron_bitdet.kernels.fp4_linear:EmulatedFP4ColumnParallelLinear",
                          "megatron_bitdet.kernels.fp4_linear:EmulatedFP4RowParallelLinear"}


def _swapped_callables():
    """Every callable the declarations swap into the installed megatron-core (a swap may apply to other
    versions only: moe_aux_loss's tracker method from 0.18, its module function before)."""
    from megatron_bitdet.compat.versions import megatron_core_version

    out = set()
    for decl in load_declarations():
        for swap in decl.swaps:
            if not swap.applies(megatron_core_version()):
                continue
            module, attr = split_symbol(swap.replacement)
            if callable(getattr(importlib.import_module(module), attr)):  # SSM_KERNELS_AVAILABLE is a flag
                out.add(swap.replacement)
    return out


def test_every_swapped_kernel_is_guarded_here():
    assert _swapped_callables() <= set(_kernel_cases()) | MODULE_CASES | MODULE_PRECISION_CASES


def test_kernel_check_passes_on_every_swapped_kernel(bitdet_kernel_check):
    for symbol, (fn, args, kwargs) in _kernel_cases().items():
        report = bitdet_kernel_check(fn, *args, threads=(1, 2), repeats=3, name=symbol, **kwargs)
        assert any(t.startswith("grad of") for t in report.tensors), symbol


# ---------------------------------------------------------------------------- module check


def embedding_builder(layout: Layout):
    """megatron's VocabParallelEmbedding in deterministic_mode, its lookup's backward the planted thread-ordered sum."""
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    from examples.planted_nondeterminism import plant_thread_order

    config = layout.transformer_config(num_layers=1, hidden_size=64, num_attention_heads=4)
    embedding = VocabParallelEmbedding(64, 64, init_method=torch.nn.init.normal_, config=config)
    plant_thread_order(embedding)
    return embedding, (torch.randint(0, 64, (8, 1024)),)


class SwappedMoEBlock(torch.nn.Module):
    """bitdet's swapped kernels as megatron uses them on an expert-parallel rank: LocalNorm, the
    grouped expert MLP, the fixed-order aux loss and the rank-ordered tracker reduction."""

    def __init__(self, layout: Layout, experts: int = 4, topk: int = 2):
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules

        from megatron_bitdet.kernels.grouped_mlp import GroupedProbMLP
        from megatron_bitdet.model.norm import LocalNorm

        config = layout.transformer_config(
            num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, moe_ffn_hidden_size=64,
            num_moe_experts=experts, moe_router_topk=topk, add_bias_linear=False, normalization="RMSNorm",
            bias_activation_fusion=False, gradient_accumulation_fusion=False, moe_aux_loss_coeff=1e-2)
        self.experts, self.topk, self.local = experts, topk, experts // layout.expert
        self.norm = LocalNorm(config, 32)
        sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        self.mlp = GroupedProbMLP(self.local, config, sub, ProcessGroupCollection.use_mpu_process_groups())

    def forward(self, hidden, logits):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe import moe_utils

        from megatron_bitdet.compat import moe_tracker
        from megatron_bitdet.compat.patching import patched
        from megatron_bitdet.kernels.moe_aux import switch_load_balancing_loss_func

        probs = torch.softmax(logits, dim=-1)
        top = probs.topk(self.topk, dim=1)
        counts = torch.zeros_like(probs, dtype=torch.bool).scatter(1, top.indices, True).sum(0)
        aux = switch_load_balancing_loss_func(probs, counts, probs.shape[0], self.topk, self.experts, 1e-2)
        moe_utils.clear_aux_losses_tracker()
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", aux.detach(), 1, 1,
                                             reduce_group=ps.get_data_parallel_group())  # crosses both ranks
        # megatron's reduction with moe_aux_loss's swap for the installed version (its module function
        # before 0.18, MoEMetricsTracker._sync_metrics from 0.18) in place
        with patched(d for d in load_declarations() if d.id == "moe_aux_loss"):
            moe_tracker.reduce(["load_balancing_loss"])
        tracked = moe_tracker.entries()["load_balancing_loss"]["values"].clone()
        first = ps.get_expert_model_parallel_rank() * self.local
        local_counts = counts[first:first + self.local]  # tokens for this rank's experts, in expert order
        rows = hidden[: int(local_counts.sum())]
        out, _ = self.mlp(self.norm(rows), local_counts, top.values.flatten()[: rows.shape[0]])
        return out, aux, tracked


def moe_block_builder(layout: Layout):
    return SwappedMoEBlock(layout), (torch.randn(512, 32).requires_grad_(), torch.randn(256, 4).requires_grad_())


@pytest.mark.timeout(600)
def test_module_check_fails_on_a_thread_ordered_megatron_embedding(bitdet_module_check, monkeypatch):
    """Every rank of both layouts sums its weight gradient in a drawn order: each is reported, read right."""
    import re

    monkeypatch.syspath_prepend(str(REPO))  # the ranks import the planted op
    with pytest.raises(NondeterminismError) as info:
        bitdet_module_check(embedding_builder, layouts=[{"tensor": 1}, {"tensor": 2}], threads=(2,),
                            repeats=2, deterministic_algorithms=False)
    text = str(info.value)
    assert f"check_module({__name__}:embedding_builder) is not bitwise repeatable" in text
    assert "grad of parameter weight:" in text and "first at [" in text and "float32:" in text
    assert "output" not in text.split("next:")[0]  # the lookup itself is exact
    assert "bitdet localize" in text
    assert set(re.findall(r"layout (tp[12]) pp1 cp1 ep1, rank ([01]), threads=2", text)) == {
        ("tp1", "0"), ("tp1", "1"), ("tp2", "0"), ("tp2", "1")}


@pytest.mark.timeout(600)
def test_module_check_passes_on_the_swapped_moe_kernels_under_two_layouts(bitdet_module_check):
    report = bitdet_module_check(moe_block_builder, layouts=[Layout(expert=1), Layout(expert=2)], threads=(2,),
                                 repeats=3)
    assert len(report.settings) == 4  # 2 layouts x 2 ranks
    assert {"output[0]", "output[1]", "output[2]", "grad of input[0]", "grad of input[1]",
            "grad of parameter norm.weight"} <= set(report.tensors)
    assert any("mlp.local_experts" in t for t in report.tensors)
    # 2 ranks x 2 threads: on fewer than 4 cores the pass says what it could not show
    oversubscribed = 4 > len(os.sched_getaffinity(0))
    assert bool(report.notes) == oversubscribed
    assert ("; note: 2 ranks x 2 threads ran on" in str(report)) == oversubscribed


def test_module_check_refuses_unimportable_builders_and_bad_layouts(bitdet_module_check):
    with pytest.raises(BitdetInputError, match="module-level function"):
        bitdet_module_check(lambda layout: None)
    with pytest.raises(BitdetInputError, match="unknown key"):
        bitdet_module_check(embedding_builder, layouts=[{"tensr": 2}])


# ---------------------------------------------------------------------------- end-to-end check


@pytest.mark.timeout(1200)  # two 2-rank launches; ~25 s on a quiet machine, minutes on a loaded one
def test_e2e_check_fails_on_the_planted_run_and_points_to_localize(bitdet_e2e_check, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # the ranks import the example provider
    with pytest.raises(NondeterminismError) as info:
        bitdet_e2e_check("nemotron_h_tiny", model_provider="examples.planted_nondeterminism:provider",
                         train_args=["--stop-at", "1"], expect_steps=1)
    text = str(info.value)
    assert "two independent runs are not bit-identical" in text
    assert "DIVERGED at step 1" in text and "next: bitdet localize" in text


def test_e2e_check_reports_a_failing_run_with_its_stderr(bitdet_e2e_check):
    with pytest.raises(BitdetError, match=r"run a failed \(exit 2\)") as info:
        bitdet_e2e_check("nemotron_h_tiny", ["model.hidden_siz=8"])
    assert "hidden_siz" in str(info.value)
