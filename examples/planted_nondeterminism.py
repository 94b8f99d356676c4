"""Two model providers whose runs diverge, for ``bitdet localize`` to find (run from the repository root):

``provider`` plants an emulated atomic add: on global rank 0 the output projection (``linear_fc2``)
of the first dense MLP layer becomes a split-K GEMM whose partial products are summed by one
dispatcher-visible op, ``bitdet_example::atomic_sum``, in an order drawn from ``os.urandom`` (not
from torch's seeded RNG), like GPU atomics. Float addition is not associative, so the bits differ
run to run; rank 1 receives the difference through collectives.

    bitdet train --recipe recipes/nemotron_h_tiny.yaml --model-provider examples.planted_nondeterminism:provider \\
        --run-dir runs/a training.iterations=3      # twice, runs/a and runs/b; then bitdet localize runs/a runs/b

The same planted op under Megatron-LM's own ``pretrain_mamba.py``: ``examples.planted_megatron_lm``.

``index_put_provider`` reproduces the real CPU nondeterminism of docs: megatron's deterministic
embedding path (``weight[ids]``, backward ``index_put_(accumulate=True)``) without torch's
deterministic algorithms; run it with ``determinism.mode=false`` (torch's flag off).

``thread_order_provider`` is that embedding made certain, for tests: its lookup is ``thread_order_gather``
(``weight[ids]``) whose backward, ``thread_order_index_add``, adds the repeated rows in an os.urandom order
on more than one thread without torch's deterministic algorithms, in index order otherwise. The real
kernel's order changes only while two threads add into one row at the same moment, which a CPU need not do
in a given run.

``autotune_provider`` makes the dense MLP linears pick a split-K kernel configuration by timing the
candidates at run time (an autotuner on a noisy benchmark: a planted os.urandom jitter on each time):
runs differ from step 1 by the choices the noise makes.
``fused_aux_loss_provider`` computes the MoE load-balancing loss with per-expert sums accumulated in
arrival order (a fused aux-loss kernel with atomics): only the aux loss differs.
"""
from __future__ import annotations

import random

import torch

from megatron_bitdet.errors import BitdetInputError

SPLITS = 8
PLANT_RANK = 0


def _arrival_order_sum(partials: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 in an order drawn from os.urandom, as atomic adds land in arrival order."""
    order = random.SystemRandom().sample(range(partials.shape[0]), partials.shape[0])
    out = partials[order[0]].clone()
    for i in order[1:]:
        out += partials[i]
    return out


@torch.library.custom_op("bitdet_example::atomic_sum", mutates_args=())
def atomic_sum(partials: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 in a run-to-run varying order (one op to the dispatcher: inputs equal, output not)."""
    return _arrival_order_sum(partials)


@atomic_sum.register_fake
def _(partials):
    return partials.new_empty(partials.shape[1:])


def _atomic_sum_backward(ctx, grad):
    return grad.unsqueeze(0).expand(ctx.n, *grad.shape)


atomic_sum.register_autograd(_atomic_sum_backward,
                             setup_context=lambda ctx, inputs, output: setattr(ctx, "n", inputs[0].shape[0]))


class SplitKAtomicLinear(torch.nn.Module):
    """Stands in for a RowParallelLinear without bias (TP1): same weight Parameter, same (out, bias) return."""

    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        self.weight = linear.weight
        object.__setattr__(self, "_linear", linear)  # not a submodule: the weight is registered once

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Checkpointed as the linear it replaces (same weight Parameter, same keys)."""
        return self._linear.sharded_state_dict(prefix, sharded_offsets, metadata)

    def get_extra_state(self):
        return self._linear.get_extra_state()

    def set_extra_state(self, state) -> None:
        self._linear.set_extra_state(state)

    def forward(self, x):
        slices = torch.arange(x.shape[-1]).chunk(SPLITS)
        partials = torch.stack([x[..., s] @ self.weight[:, s].t() for s in slices])
        return atomic_sum(partials), None


def provider(recipe, config, *, pre_process: bool = True, post_process: bool = True):
    """The default hybrid with the planted split-K atomic sum in the first dense MLP, on rank PLANT_RANK."""
    from megatron.core.ssm.mlp_layer import MLPLayer

    from megatron_bitdet.model.builder import default_model_provider

    if config.tensor_model_parallel_size != 1:
        raise BitdetInputError("examples.planted_nondeterminism:provider plants a TP1 linear; use parallel.tensor=1")
    model = default_model_provider(recipe, config, pre_process=pre_process, post_process=post_process)
    if torch.distributed.get_rank() == PLANT_RANK:
        mlp = next((layer.mlp for layer in model.modules() if isinstance(layer, MLPLayer)), None)
        if mlp is None:
            raise BitdetInputError("examples.planted_nondeterminism:provider needs a dense '-' layer in the pattern")
        mlp.linear_fc2 = SplitKAtomicLinear(mlp.linear_fc2)
    return model


def index_put_provider(recipe, config, *, pre_process: bool = True, post_process: bool = True):
    """The default hybrid with megatron's deterministic embedding path switched on for the embedding only."""
    from megatron_bitdet.model.builder import default_model_provider

    model = default_model_provider(recipe, config, pre_process=pre_process, post_process=post_process)
    if pre_process:
        model.embedding.word_embeddings.deterministic_mode = True
    return model


# --------------------------------------------------------------------------- a thread-scheduled accumulation
def _threads_race() -> bool:
    """Where a parallel accumulation's threads would race: several intra-op threads, torch's deterministic
    algorithms off."""
    return torch.get_num_threads() > 1 and not torch.are_deterministic_algorithms_enabled()


@torch.library.custom_op("bitdet_example::thread_order_index_add", mutates_args=())
def thread_order_index_add(values: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """``zeros(rows, ...)`` with ``values[i]`` added into row ``index[i]``, as index_put_(accumulate=True) sums:
    in an order drawn from os.urandom where threads would race (they add as they arrive), else in index order."""
    n = index.shape[0]
    order = (torch.randperm(n, generator=torch.Generator().manual_seed(random.SystemRandom().getrandbits(63)))
             if _threads_race() else torch.arange(n))
    return values.new_zeros((rows, *values.shape[1:])).index_add_(0, index[order], values[order])


@thread_order_index_add.register_fake
def _(values, index, rows):
    return values.new_empty((rows, *values.shape[1:]))


@torch.library.custom_op("bitdet_example::thread_order_gather", mutates_args=())
def thread_order_gather(weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``weight[index]`` (exact); the backward adds the gradient rows with thread_order_index_add."""
    return weight[index]


@thread_order_gather.register_fake
def _(weight, index):
    return weight.new_empty((*index.shape, *weight.shape[1:]))


def _gather_backward(ctx, grad):
    index, = ctx.saved_tensors
    return thread_order_index_add(grad.reshape(-1, *grad.shape[index.dim():]), index.reshape(-1), ctx.rows), None


thread_order_gather.register_autograd(
    _gather_backward, setup_context=lambda ctx, inputs, output: (ctx.save_for_backward(inputs[1]),
                                                                 setattr(ctx, "rows", inputs[0].shape[0])))


class ThreadOrderLookup(torch.overrides.TorchFunctionMode):
    """Routes ``weight[ids]`` (megatron's deterministic-mode embedding lookup) to thread_order_gather."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and args[0] is self.weight:
            return thread_order_gather(*args)
        return func(*args, **(kwargs or {}))


def plant_thread_order(embedding) -> None:
    """Puts megatron's VocabParallelEmbedding on its deterministic-mode path with the lookup planted."""
    embedding.deterministic_mode = True
    forward = embedding.forward

    def planted(input_):
        with ThreadOrderLookup(embedding.weight):
            return forward(input_)

    embedding.forward = planted


def thread_order_provider(recipe, config, *, pre_process: bool = True, post_process: bool = True):
    """The default hybrid whose embedding's backward sums repeated token rows in thread order (planted)."""
    from megatron_bitdet.model.builder import default_model_provider

    model = default_model_provider(recipe, config, pre_process=pre_process, post_process=post_process)
    if pre_process:
        plant_thread_order(model.embedding.word_embeddings)
    return model


# --------------------------------------------------------------------------- a run-time kernel choice
AUTOTUNE_SPLITS = (1, 2, 4, 8)


def _splitk(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """x @ weight.T with the reduction dim cut into ``splits`` chunks summed in order: deterministic for
    one configuration, but each split count rounds differently."""
    k = x.shape[-1]
    step = -(-k // splits)
    out = x[..., :step] @ weight[:, :step].t()
    for s in range(step, k, step):
        out = out + x[..., s:s + step] @ weight[:, s:s + step].t()
    return out


def _splitk_op(splits: int):
    """One dispatcher op per configuration, as an autotuner compiles one kernel per config."""
    @torch.library.custom_op(f"bitdet_example::splitk{splits}_matmul", mutates_args=())
    def op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _splitk(x, weight, splits)

    op.register_fake(lambda x, weight: x.new_empty((*x.shape[:-1], weight.shape[0])))

    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])

    op.register_autograd(backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))
    return op


SPLITK_OPS = {n: _splitk_op(n) for n in AUTOTUNE_SPLITS}


class AutotunedLinear(torch.nn.Module):
    """A TP1 linear without bias whose kernel configuration (split count) is picked by timing every
    candidate once on the live input at each call and keeping the fastest, like an autotuner whose
    cache never hits, on a benchmark noisier than the candidates' differences: each measured time gets an
    os.urandom draw of up to JITTER x the slowest candidate's. The machine's own timing noise need not
    decide (here the 1-split kernel won ~2 calls in 3; a quiet fast CPU may pick it every time); with the
    draw two runs pick differently and round differently from their first step, on any machine."""

    JITTER = 10

    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        self.weight = linear.weight

    def _tune(self, x) -> int:
        import time

        times = {}
        with torch.no_grad():
            for splits in AUTOTUNE_SPLITS:
                t0 = time.perf_counter_ns()
                SPLITK_OPS[splits](x.detach(), self.weight.detach())
                times[splits] = time.perf_counter_ns() - t0
        noise, spread = random.SystemRandom(), self.JITTER * max(times.values())
        return min(times, key=lambda splits: times[splits] + noise.uniform(0, spread))

    def forward(self, x):
        return SPLITK_OPS[self._tune(x)](x, self.weight), None


def autotune_provider(recipe, config, *, pre_process: bool = True, post_process: bool = True):
    """The default hybrid whose dense MLP linears pick a split-K configuration by timing at every call."""
    from megatron.core.ssm.mlp_layer import MLPLayer

    from megatron_bitdet.model.builder import default_model_provider

    if config.tensor_model_parallel_size != 1:
        raise BitdetInputError("examples.planted_nondeterminism:autotune_provider plants TP1 linears; use parallel.tensor=1")
    model = default_model_provider(recipe, config, pre_process=pre_process, post_process=post_process)
    for layer in model.modules():
        if isinstance(layer, MLPLayer):
            layer.mlp.linear_fc1 = AutotunedLinear(layer.mlp.linear_fc1)
            layer.mlp.linear_fc2 = AutotunedLinear(layer.mlp.linear_fc2)
    return model


# --------------------------------------------------------------------------- a fused aux loss with atomics
@torch.library.custom_op("bitdet_example::atomic_expert_sum", mutates_args=())
def atomic_expert_sum(probs: torch.Tensor, blocks: int) -> torch.Tensor:
    """Per-expert column sums of ``probs`` accumulated block of tokens by block in an order drawn from
    os.urandom: a fused aux-loss kernel whose CTAs atomicAdd their partial sums."""
    return _arrival_order_sum(torch.stack([p.sum(dim=0) for p in probs.float().chunk(blocks)]))


@atomic_expert_sum.register_fake
def _(probs, blocks):
    return probs.new_empty(probs.shape[1:], dtype=torch.float32)


atomic_expert_sum.register_autograd(
    lambda ctx, grad: (grad.unsqueeze(0).expand(ctx.shape).to(ctx.dtype), None),
    setup_context=lambda ctx, inputs, output: (setattr(ctx, "shape", inputs[0].shape),
                                               setattr(ctx, "dtype", inputs[0].dtype)))


def fused_aux_loss(probs, tokens_per_expert, total_num_tokens, topk, num_experts, moe_aux_loss_coeff,
                   fused=False, padding_mask=None):
    """megatron's switch load-balancing loss with the per-expert probability sums made "fused": atomics."""
    if padding_mask is not None:
        probs = probs * padding_mask.unsqueeze(-1)
    aggregated = atomic_expert_sum(probs, probs.shape[0])  # one "CTA" per token row
    return torch.sum(aggregated * tokens_per_expert) * (
        num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens))


def fused_aux_loss_provider(recipe, config, *, pre_process: bool = True, post_process: bool = True):
    """The default hybrid whose MoE routers compute the load-balancing loss with the atomic "fused" sum
    (what moe_router_fusion does on a GPU): only the MoE aux loss differs run to run."""
    from megatron.core.transformer.moe import router

    from megatron_bitdet.model.builder import default_model_provider

    router.switch_load_balancing_loss_func = fused_aux_loss
    return default_model_provider(recipe, config, pre_process=pre_process, post_process=post_process)
