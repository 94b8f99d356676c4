"""The pretraining loop on megatron-core: one function per rank (``worker``), launched by
``train.launch``. Every step appends a fingerprint line; checkpoints save the full state.
With a ``Tracer`` the steps inside its window are traced (phases forward / backward, grad_reduce,
optimizer); without one nothing is installed. ``StepHook`` objects (replay: verification, module
statistics, counterfactual changes) are called around every step."""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from megatron_bitdet.compat import moe_tracker
from megatron_bitdet.fingerprint.steps import StepFingerprintWriter
from megatron_bitdet.kernels.moe_aux import gather_ranks, rank_ordered_sum, tree_sum
from megatron_bitdet.train.console import Console
from megatron_bitdet.train.module_state import capture_module_rng, restore_module_rng
from megatron_bitdet.train.step_fingerprints import StepDigests, ddp_buffers, moe_aux_losses, step_metrics
from megatron_bitdet.train.tracing import traced_optimizer_step, traced_step, untraced


_CURRENT = {"step": 0}


def current_step() -> int:
    """The iteration in flight (from 1; 0 outside training): for model providers and hooks that act at
    a given step, e.g. a planted fault that must come back when the step is replayed."""
    return _CURRENT["step"]


class StepHook:
    """Called by ``train_steps`` around each step; the base class changes nothing."""

    def begin(self, step: int, state, batches):
        """Before the step's first micro-batch; returns the iterator its micro-batches come from."""
        return batches

    def end(self, step: int, line: dict) -> bool:
        """After the step's fingerprint ``line`` was written; True stops training after this step."""
        return False


def _loss_func(loss_mask, output_tensor):
    """Megatron's masked LM loss: (sum, tokens, report) so schedules divide by the token count."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.detach().float()])}


def forward_step(data_iterator, model):
    """megatron's ``forward_step_func``: the next micro-batch through the model, and its loss function."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


# recipe model.moe.load_balancing -> the name megatron's router logs the loss under
_TRACKER_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}


def tracked_aux_name(recipe):
    return _TRACKER_NAMES.get(recipe.model.moe.load_balancing) if recipe.model.has("E") else None


def aux_tracker_entry(recipe, name: str) -> dict:
    """The tracker's entry for ``name``; a pipeline stage without MoE layers gets zeros, so that it
    still joins the PP-group sum."""
    return moe_tracker.entry(name, len(recipe.model.hybrid_pattern))


def _take_aux(recipe):
    """One hosted virtual rank's per-layer aux-loss sums (its micro-batches, in order), zeroed after."""
    name = tracked_aux_name(recipe)
    if name is None:
        return None
    values = aux_tracker_entry(recipe, name)["values"]
    taken = values.clone()
    values.zero_()
    return taken


def virtual_aux_average(entry: dict, hosted: list, virtual) -> torch.Tensor:
    """Megatron's PP sum and reduce-group sum, then the DP average as the pairwise tree over the virtual
    ranks' values (gathered, put in virtual-rank order) divided by V."""
    from megatron.core import parallel_state as ps

    values = rank_ordered_sum(torch.stack(hosted), ps.get_pipeline_model_parallel_group())
    if entry.get("reduce_group") is not None:
        values = rank_ordered_sum(values, entry["reduce_group"])
    group = ps.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False)
    per_virtual = torch.cat(gather_ranks(values, group))[virtual.gathered_order()]
    average = tree_sum(per_virtual) / per_virtual.shape[0]
    if entry.get("avg_group") is not None:
        average = rank_ordered_sum(average, entry["avg_group"]) / torch.distributed.get_world_size(entry["avg_group"])
    return average


def _moe_aux_losses(recipe, num_microbatches: int, hosted=None, virtual=None) -> dict:
    """Per-layer load-balancing losses reduced across ranks as Megatron-LM's ``track_moe_metrics``
    does (PP sum, reduce group, DP average), then cleared. The reduction is megatron's own
    (``compat.moe_tracker.reduce``), so under the ``moe_aux_loss`` swap its rank-ordered sum is what runs.
    ``hosted`` (dp_invariant): the hosted virtual ranks' values, averaged over the virtual layout instead."""
    name = tracked_aux_name(recipe)
    if name is not None:
        entry = aux_tracker_entry(recipe, name)
        if hosted is None:
            moe_tracker.reduce([name])
        else:
            entry["values"].copy_(virtual_aux_average(entry, hosted, virtual))
    return moe_aux_losses(num_microbatches, names=[name] if name else [])


def reported_lm_loss(losses_reduced, virtual=None, key: str = "lm loss"):
    """DP-averaged LM loss (``key``'s report), as Megatron reports it (None off the last pipeline stage).
    ``virtual`` (dp_invariant): every micro-batch's (loss sum, tokens) gathered in global micro-batch order
    and added by the pairwise tree, the same bits at any DP."""
    from megatron.core import parallel_state as ps

    if not losses_reduced:
        return None
    group = ps.get_data_parallel_group(with_context_parallel=True)
    per_microbatch = torch.stack([x[key].view(-1) for x in losses_reduced])
    if virtual is None:
        total = per_microbatch.sum(dim=0)
        torch.distributed.all_reduce(total, group=group)
    else:  # rows (rank, hosted in run order, micro-batch) -> (virtual rank, micro-batch)
        gathered = torch.cat(gather_ranks(per_microbatch, group)).view(-1, len(losses_reduced) // virtual.hosted, 2)
        total = tree_sum(gathered[virtual.gathered_order()].view(-1, 2))
    return total[0] / total[1]


@dataclass
class StepOutput:
    losses: list          # megatron's per-micro-batch loss reports (empty off the last pipeline stage)
    ok: bool              # False: the optimizer skipped the step
    grad_norm: float | None
    lr: float             # the learning rate the step used
    hosted_aux: list | None = None  # dp_invariant: each hosted virtual rank's per-layer aux-loss sums


def hosted_forward_backward(state, run) -> tuple[list, list]:
    """dp_invariant: each hosted virtual rank's micro-batches (in ``VirtualLayout.runs`` order, as the
    sampler deals them), from the step's RNG state (a rank at
    DP = V starts there too: megatron's seeds do not depend on the DP rank) into zeroed buffers; the
    hosted gradients added by ``GradTree``; then megatron's finalize once (1/V scaling, the cross-rank
    pairwise tree). Returns the micro-batch loss reports and each virtual rank's aux-loss values."""
    from megatron_bitdet.train.checkpoint import capture_rng, restore_rng
    from megatron_bitdet.train.reductions import GradTree

    config, model, hosted = state.config, state.ddp_modules, state.virtual.hosted
    chunks = [m.module for m in model]
    tree = GradTree(ddp_buffers(model, "grad_data")) if hosted > 1 else None
    start = (capture_rng(), capture_module_rng(chunks)) if hosted > 1 else None
    finalize, config.finalize_model_grads_func = config.finalize_model_grads_func, None
    losses, aux = [], []
    try:
        for h in range(hosted):
            if h:
                restore_rng(start[0])
                restore_module_rng(chunks, start[1], source="the step's start")
                for m in model:
                    m.zero_grad_buffer()
            losses += run()
            aux.append(_take_aux(state.recipe))
            if tree is not None:
                tree.push()
        if tree is not None:
            tree.write_back()
    finally:
        config.finalize_model_grads_func = finalize
    finalize(model, None)
    return losses, None if aux[0] is None else aux


def train_step(state, data, forward_backward, *, tracer=None, step: int = 0, digests: StepDigests | None = None,
               batches=None) -> StepOutput:
    """One training step as megatron-LM runs it: zero the gradient buffers, forward and backward over
    every micro-batch, optimizer step, scheduler step. Traced when ``tracer``'s window holds ``step``;
    ``digests`` launches the reduced gradients' digests before the optimizer consumes them (on their
    device, no host sync); ``batches`` (default ``data``) is the iterator the micro-batches come from."""
    model, recipe = state.ddp_modules, state.recipe
    for m in model:
        m.zero_grad_buffer()
    state.optimizer.zero_grad()
    hosted_aux = None
    with traced_step(tracer, state.config, model, step) as tr:
        run = partial(
            forward_backward, forward_step_func=forward_step, data_iterator=data if batches is None else batches,
            model=model, num_microbatches=data.num_microbatches, seq_length=recipe.model.seq_length,
            micro_batch_size=recipe.training.micro_batch_size, forward_only=False,
        )
        if state.virtual is None:
            losses = run()
        else:
            losses, hosted_aux = hosted_forward_backward(state, run)
        if digests is not None:
            with untraced(tr):
                digests.grads(step)
        ok, grad_norm, _ = traced_optimizer_step(tr, state.optimizer, model)
        if recipe.parallel.overlap_param_gather:  # the all-gather the next forward would wait on, done now:
            for m in model:  # the step's params digest, snapshots and checkpoints read the updated parameters
                m.start_param_sync(force_sync=True)
    lr = state.optimizer.param_groups[0]["lr"]
    state.scheduler.step(increment=1)
    return StepOutput(losses, ok, grad_norm, lr, hosted_aux)


def train_steps(state, data, *, run_dir: Path, start: int, stop: int, save_root, save_interval: int,
                manifest: dict, console: Console, snapshot_at=frozenset(), snapshot_full=None, tracer=None, hooks=(),
                writer: StepFingerprintWriter | None = None) -> None:
    """Steps ``start + 1`` to ``stop``, each fingerprinted into ``writer`` (default: this rank's
    writer in ``run_dir``, opened here and closed, fsync'd, at the end): the digests are launched in
    the step and after it, and read back when the line is written (``StepDigests``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_bitdet.train import checkpoint
    from megatron_bitdet.train.snapshot import take_snapshot

    recipe, rank = state.recipe, torch.distributed.get_rank()
    moe_coeff = recipe.model.moe.aux_loss_coeff
    forward_backward = get_forward_backward_func()
    own_writer = writer is None
    if own_writer:
        writer = StepFingerprintWriter(run_dir, rank)
    model = state.ddp_modules
    chunks = [m.module for m in model]
    digests = StepDigests(model, optimizer=state.optimizer, logical_digests=state.virtual is not None)
    try:
        for step in range(start + 1, stop + 1):
            t0 = time.perf_counter()
            _CURRENT["step"] = step
            batches = data
            for hook in hooks:
                batches = hook.begin(step, state, batches)
            out = train_step(state, data, forward_backward, tracer=tracer, step=step, digests=digests,
                             batches=batches)
            digests.state(step)
            losses, ok, grad_norm, lr = out.losses, out.ok, out.grad_norm, out.lr
            elapsed = time.perf_counter() - t0
            lm_loss = reported_lm_loss(losses, state.virtual)
            aux = _moe_aux_losses(recipe, data.num_microbatches, out.hosted_aux, state.virtual)
            metrics = step_metrics(lm_loss=lm_loss, aux=aux, aux_coeff=moe_coeff, grad_norm=grad_norm, lr=lr)
            aux_total = metrics["aux_loss"]
            line = writer.write(step, metrics, *digests.resolve())
            console.step(step, stop, elapsed_ms=elapsed * 1000, lr=lr, lm_loss=lm_loss, aux=aux_total,
                         grad_norm=grad_norm, consumed=data.consumed_samples, skipped=0 if ok else 1)
            if save_root and save_interval and step % save_interval == 0:
                checkpoint.save_checkpoint(
                    save_root, step, ddp_modules=model, optimizer=state.optimizer, scheduler=state.scheduler,
                    rank_state={"rng": checkpoint.capture_rng(), "data": data.state_dict(),
                                "module_rng": capture_module_rng(chunks)}, manifest=manifest,
                )
                console.note(f"saved checkpoint iteration {step} to {save_root}")
            if step in snapshot_at:
                take_snapshot(run_dir, step, rank=rank, ddp_modules=model, optimizer=state.optimizer,
                              scheduler=state.scheduler, data=data, full=snapshot_full)
            if any([hook.end(step, line) for hook in hooks]):  # every hook sees the step
                break
    finally:
        _CURRENT["step"] = 0
        if own_writer:
            writer.close()
