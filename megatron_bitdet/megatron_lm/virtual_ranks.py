"""``determinism.reductions: dp_invariant`` under Megatron-LM's own loop: the same virtual layout as
``bitdet train`` (``train.reductions``, ``train.loop``), on Megatron-LM's seams.

- the gradient reduction's pairwise tree, the exact grad norm in the clip path: ``train.reductions.install``
  at ``validate_args`` (c10d's float reductions swapped, ``get_grad_norm_fp32`` rebound);
- at the first step every DDP bucket pre-scales by 1/V (``scale_by_virtual_dp``);
- ``train_step``'s ``forward_backward_func`` is replaced (``VirtualSteps.forward_backward``): the step's micro-batches, drawn from
  Megatron's data iterator, are dealt to the hosted virtual ranks (Megatron's sampler gives rank ``r`` of DP
  micro-batch ``k = j*h + e`` = virtual rank ``r + e*DP``'s micro-batch ``j``: exactly the hosted ones), and
  the schedule runs once per virtual rank, each from the step's RNG state into zeroed buffers, added by
  ``GradTree``, then Megatron's ``finalize_model_grads`` once (``train.loop.hosted_forward_backward``);
- the loss and aux-loss sums: the step's loss report is the pairwise tree over every virtual rank's
  micro-batches (``train.loop.reported_lm_loss``), and the tracker holds the virtual ranks' aux-loss average
  (``virtual_aux_average``) times the hosted count, so Megatron's logging (DP average of equal values,
  ``1 / num_microbatches``) and the fingerprint read the DP = V bits;
- the fingerprints carry the logical digests (``StepDigests(logical_digests=True)``).

What is not installed is refused before any rank starts (``refusals``: rule ``reductions_not_installed``).
"""
from __future__ import annotations

from dataclasses import dataclass

# (args attribute, is it set, the line's flag as the message names it, the fix)
UNINSTALLED = (
    ("use_distributed_optimizer", bool, "--use-distributed-optimizer", "drop --use-distributed-optimizer"),
    ("overlap_grad_reduce", bool, "--overlap-grad-reduce", "drop --overlap-grad-reduce"),
    ("overlap_param_gather", bool, "--overlap-param-gather", "drop --overlap-param-gather"),
    ("tensor_model_parallel_size", lambda v: (v or 1) > 1, "--tensor-model-parallel-size",
     "use --tensor-model-parallel-size 1"),
    ("pipeline_model_parallel_size", lambda v: (v or 1) > 1, "--pipeline-model-parallel-size",
     "use --pipeline-model-parallel-size 1"),
    ("context_parallel_size", lambda v: (v or 1) > 1, "--context-parallel-size", "use --context-parallel-size 1"),
    ("expert_model_parallel_size", lambda v: (v or 1) > 1, "--expert-model-parallel-size",
     "use --expert-model-parallel-size 1"),
    ("calculate_per_token_loss", bool, "--calculate-per-token-loss", "drop --calculate-per-token-loss"),
    ("ddp_average_in_collective", bool, "--ddp-average-in-collective", "drop --ddp-average-in-collective"),
    ("data_parallel_random_init", bool, "--data-parallel-random-init", "drop --data-parallel-random-init"),
    ("rampup_batch_size", bool, "--rampup-batch-size", "drop --rampup-batch-size"),
    ("dataloader_type", lambda v: v not in (None, "single"), "--dataloader-type", "use --dataloader-type single"),
)
WHY = ("under Megatron-LM's loop bitdet installs the DP-invariant reductions for plain data parallelism only "
       "(DDP without the distributed optimizer or overlap, one model-parallel rank, Megatron's single sampler); "
       "with this flag the run would reduce natively somewhere and its bits would follow the data-parallel size")


def refusals(args, recipe) -> list[tuple[str, str]]:
    """(what, fix) for each part of the line the mode is not installed for under Megatron-LM's loop,
    and a data-parallel size or batch the virtual layout cannot host."""
    out = []
    for attr, is_set, flag, fix in UNINSTALLED:
        value = getattr(args, attr, None)
        if is_set(value):
            out.append((flag if value is True else f"{flag} {value}", fix))
    d = recipe.determinism
    dp = getattr(args, "data_parallel_size", None)
    issue = d.virtual_dp_issue(dp) if dp else None
    if issue:
        out.append((issue, f"launch at a data-parallel size dividing {d.virtual_dp}"))
    mbs, gbs = getattr(args, "micro_batch_size", None), getattr(args, "global_batch_size", None)
    if mbs and gbs and gbs % (mbs * d.virtual_dp):
        out.append((f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs} x "
                    f"determinism.virtual_dp {d.virtual_dp}", "use a global batch the virtual ranks split evenly"))
    return out


@dataclass
class HostedState:
    """What ``train.loop.hosted_forward_backward`` reads of a step, named as in bitdet's loop."""

    ddp_modules: list
    config: object
    recipe: object
    virtual: object


class VirtualSteps:
    """One rank's virtual layout under Megatron-LM's loop (made at the first step: it needs the
    parallel state)."""

    def __init__(self, recipe, model):
        from megatron_bitdet.train.reductions import scale_by_virtual_dp, virtual_layout

        self.recipe, self.model = recipe, model
        self.virtual = virtual_layout(recipe)
        scale_by_virtual_dp(model, self.virtual.virtual_dp)
        self.losses: list = []  # the step's micro-batch loss reports, hosted virtual ranks in run order

    def forward_backward(self, original, config):
        """Megatron's ``forward_backward_func`` run once per hosted virtual rank, each on its micro-batches."""
        def forward_backward_func(*, data_iterator, num_microbatches, **kw):
            from megatron_bitdet.kernels.reductions import bit_reversed
            from megatron_bitdet.train.loop import hosted_forward_backward

            hosted = self.virtual.hosted
            batches = None if data_iterator is None else [next(data_iterator) for _ in range(num_microbatches)]
            deals = iter([None if batches is None else iter(batches[e::hosted]) for e in bit_reversed(hosted)])

            def run():
                return original(data_iterator=next(deals), num_microbatches=num_microbatches // hosted, **kw)

            state = HostedState(self.model, config, self.recipe, self.virtual)
            self.losses, aux = hosted_forward_backward(state, run)
            if aux is not None:
                self._aux_average(aux)
            return self.losses

        return forward_backward_func

    def _aux_average(self, aux) -> None:
        """The tracker's values become the virtual ranks' average times the hosted count: Megatron's
        logging divides by its num_microbatches (hosted x a virtual rank's), exactly as at DP = V."""
        from megatron_bitdet.train.loop import tracked_aux_name, aux_tracker_entry, virtual_aux_average

        entry = aux_tracker_entry(self.recipe, tracked_aux_name(self.recipe))
        entry["values"].copy_(virtual_aux_average(entry, aux, self.virtual) * self.virtual.hosted)

    def step_result(self, result):
        """Megatron's train_step result with each (sum, count) loss the pairwise tree over the virtual ranks'
        micro-batches (Megatron's own sum followed the DP size)."""
        from megatron_bitdet.train.loop import reported_lm_loss

        if not result or not result[0] or not self.losses:
            return result
        losses = dict(result[0])
        for key in losses:
            if self.losses[0][key].numel() == 2:
                losses[key] = reported_lm_loss(self.losses, self.virtual, key=key)
        return (losses, *result[1:])
