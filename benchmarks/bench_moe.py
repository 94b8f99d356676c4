"""Deterministic MoE variants vs their fast megatron baselines, forward+backward, measured in one run.

Run: python benchmarks/bench_moe.py   (about a minute on 2 idle CPU cores)
* fixed-order aux loss vs megatron's unfused ``switch_load_balancing_loss_func``;
* GroupedProbMLP (segment GEMMs, private-slot dprob) vs megatron's SequentialMLP loop, same weights.
Configurations are interleaved per round; prints median ms of each and the ratio ours/baseline.
"""
from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_bitdet.compat import cpu_backend

cpu_backend.install()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.activations import squared_relu  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer.mlp import MLPSubmodules  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_bitdet.kernels.grouped_mlp import GroupedProbMLP  # noqa: E402
from megatron_bitdet.kernels.moe_aux import DEFAULT_AUX_CONFIG, switch_load_balancing_loss_func  # noqa: E402

ROUNDS, WARMUP = 15, 3


@dataclass(frozen=True)
class MLPSize:
    name: str
    tokens: int
    hidden: int
    ffn: int
    experts: int


AUX_SIZES = [(4096, 64), (32768, 128)]
AUX_BLOCK = DEFAULT_AUX_CONFIG.block_rows
MLP_SIZES = [MLPSize("tiny", 64, 32, 64, 4), MLPSize("modest", 4096, 256, 512, 8)]


def interleaved_medians(fns):
    """Median seconds per fn, all fns timed once per round (interleaved), warm-up excluded."""
    times = [[] for _ in fns]
    for r in range(WARMUP + ROUNDS):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            if r >= WARMUP:
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def aux_case(func, probs, counts, tokens, experts):
    def run():
        p = probs.detach().requires_grad_()
        func(p, counts, tokens, 6, experts, 1e-2).backward()

    return run


def mlp_case(module, x, counts, probs):
    def run():
        xi, pi = x.detach().requires_grad_(), probs.detach().requires_grad_()
        out, _ = module(xi, counts, pi)
        out.backward(torch.ones_like(out))
        module.zero_grad(set_to_none=True)

    return run


def main():
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"{'case':38s} {'baseline ms':>12s} {'ours ms':>9s} {'ours/base':>10s}")
    g = torch.Generator().manual_seed(0)
    for tokens, experts in AUX_SIZES:
        probs = torch.softmax(torch.randn(tokens, experts, generator=g), -1)
        counts = torch.randint(0, tokens, (experts,), generator=g)
        base, ours = interleaved_medians(
            [aux_case(f, probs, counts, tokens, experts) for f in (moe_utils.switch_load_balancing_loss_func, switch_load_balancing_loss_func)]
        )
        print(f"{f'aux loss T={tokens} E={experts}':38s} {base * 1e3:12.3f} {ours * 1e3:9.3f} {ours / base:10.2f}")
        fwd = [lambda f=f: f(probs, counts, tokens, 6, experts, 1e-2)
               for f in (moe_utils.switch_load_balancing_loss_func, switch_load_balancing_loss_func)]
        fb, fo = interleaved_medians(fwd)
        print(f"{'  forward only':38s} {fb * 1e3:12.3f} {fo * 1e3:9.3f} {fo / fb:10.2f}")
        levels = sum(math.ceil(math.log2(n)) for n in (AUX_BLOCK, math.ceil(tokens / AUX_BLOCK), experts) if n > 1)
        view = torch.empty(2, 1)
        (add,) = interleaved_medians([lambda: view[0].add_(view[1])])
        print(f"{'  (tree: %d dependent levels; one eager add on a tiny view costs %.1f us)' % (levels, add * 1e6):38s}")
    for s in MLP_SIZES:
        config = TransformerConfig(
            num_layers=1, hidden_size=s.hidden, num_attention_heads=4, ffn_hidden_size=s.ffn, moe_ffn_hidden_size=s.ffn,
            num_moe_experts=s.experts, add_bias_linear=False, use_cpu_initialization=True, activation_func=squared_relu,
            bias_activation_fusion=False, gradient_accumulation_fusion=False,
        )
        sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        pg = ProcessGroupCollection.use_mpu_process_groups()
        ref, ours_mod = SequentialMLP(s.experts, config, sub, pg), GroupedProbMLP(s.experts, config, sub, pg)
        ours_mod.load_state_dict(ref.state_dict())
        cuts = torch.sort(torch.randint(0, s.tokens + 1, (s.experts - 1,), generator=g)).values
        counts = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([s.tokens])]))
        x, probs = torch.randn(s.tokens, s.hidden, generator=g), torch.rand(s.tokens, generator=g)
        base, ours = interleaved_medians([mlp_case(m, x, counts, probs) for m in (ref, ours_mod)])
        label = f"experts {s.name} T={s.tokens} H={s.hidden} F={s.ffn} E={s.experts}"
        print(f"{label:38s} {base * 1e3:12.3f} {ours * 1e3:9.3f} {ours / base:10.2f}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
