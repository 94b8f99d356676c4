"""Everything before the first step, in the order determinism needs: enforcement, CPU seams,
patches, parallel state, seeds, model, DDP, optimizer, scheduler."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TrainState:
    recipe: object
    config: object
    ddp_modules: list
    optimizer: object
    scheduler: object
    enforcement: object
    patches: list
    cpu_seams: list
    virtual: object = None  # train.reductions.VirtualLayout under dp_invariant: the virtual ranks hosted here


def set_seeds(seed: int) -> None:
    """Megatron-LM's scheme: one seed per pipeline stage, then megatron's TP / EP / DP tracker streams."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def init_parallel(recipe) -> None:
    from megatron.core import parallel_state as ps

    p = recipe.parallel
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        context_parallel_size=p.context,
        expert_model_parallel_size=p.expert,
        expert_tensor_parallel_size=p.expert_tensor,
    )


def check_determinism_kept(recipe, config, provider) -> None:
    """A model provider is user code run after enforcement: refuse it if it switched determinism off
    (torch's flags, megatron's deterministic_mode), instead of recording a deterministic run that is not."""
    from megatron_bitdet.errors import BitdetInputError

    if not recipe.determinism.mode:
        return
    lost = [what for what, off in (
        ("torch.use_deterministic_algorithms is off", not torch.are_deterministic_algorithms_enabled()),
        ("torch deterministic algorithms are warn-only", torch.is_deterministic_algorithms_warn_only_enabled()),
        ("torch.backends.cudnn.deterministic is off", not torch.backends.cudnn.deterministic),
        ("torch.backends.cudnn.benchmark is on", torch.backends.cudnn.benchmark),
        ("TransformerConfig.deterministic_mode is False", not getattr(config, "deterministic_mode", False)),
    ) if off]
    if lost:
        name = f"{getattr(provider, '__module__', '?')}:{getattr(provider, '__qualname__', provider)}"
        raise BitdetInputError(f"model provider {name}: after it ran, {'; '.join(lost)} (determinism.mode is "
                               "true): a provider must leave the determinism settings as enforcement made them")


def build_model(recipe, config, provider) -> list:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    model = provider(
        recipe, config,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
    )
    check_determinism_kept(recipe, config, provider)
    if config.bf16 or config.fp16:
        # megatron's mixed-precision wrapper, as Megatron-LM's get_model applies it: every parameter in
        # 16 bits (Mamba's fp32-initialized A_log / D / dt_bias too), fp32 outputs on the last stage.
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=recipe.parallel.overlap_grad_reduce,
        overlap_param_gather=recipe.parallel.overlap_param_gather,
        use_distributed_optimizer=recipe.parallel.distributed_optimizer,
    )
    return [DistributedDataParallel(config, ddp_config, model)]


def build_optimizer(recipe, config, ddp_modules):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o, t = recipe.training.optimizer, recipe.training
    opt_config = OptimizerConfig(
        optimizer=o.name, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.clip_grad,
        bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype,
        use_distributed_optimizer=recipe.parallel.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, ddp_modules)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if t.lr_schedule.warmup_iters else o.lr, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=t.lr_schedule.warmup_iters, lr_decay_steps=t.iterations, lr_decay_style=t.lr_schedule.style,
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=t.iterations, wd_incr_style="constant",
    )
    return optimizer, scheduler


def build_trainable(recipe, *, swaps, provider, enforcement=None, patches=(), seams=()) -> TrainState:
    """Seeds, config, model, DDP, optimizer, scheduler and megatron's grad hooks, on an existing
    parallel state (``tax`` builds several of these side by side)."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_bitdet.model.builder import transformer_config
    from megatron_bitdet.train.reductions import scale_by_virtual_dp, virtual_layout

    set_seeds(recipe.training.seed)
    config = transformer_config(recipe, swapped=[s["id"] for s in swaps])
    ddp_modules = build_model(recipe, config, provider)
    optimizer, scheduler = build_optimizer(recipe, config, ddp_modules)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp_modules[0].no_sync
    if recipe.parallel.overlap_grad_reduce:  # as Megatron-LM's training sets them (align_*: the defaults)
        config.grad_sync_func = ddp_modules[0].start_grad_sync
    if recipe.parallel.overlap_param_gather:
        config.param_sync_func = ddp_modules[0].start_param_sync
    virtual = virtual_layout(recipe)
    if virtual is not None:
        scale_by_virtual_dp(ddp_modules, virtual.virtual_dp)
    return TrainState(recipe, config, ddp_modules, optimizer, scheduler, enforcement, list(patches), list(seams),
                      virtual)


def setup(recipe, enforcement, *, provider) -> TrainState:
    """Order matters: CPU seams before megatron modules that import GPU packages, patches before the
    spec is built, parallel state and seeds before the model."""
    from megatron_bitdet.compat import cpu_backend, patching
    from megatron_bitdet.model.builder import resolve_spec_family
    from megatron_bitdet.train import reductions

    seams = cpu_backend.install()
    swaps = enforcement.rules.swaps
    patches = patching.apply_for(recipe, family=resolve_spec_family(recipe), swaps=swaps)
    init_parallel(recipe)
    installed = reductions.install(recipe.determinism.reductions)
    patches = patches + ([installed] if installed else [])
    state = build_trainable(recipe, swaps=swaps, provider=provider, enforcement=enforcement,
                            patches=patches, seams=seams)
    if state.virtual is not None:  # what the mode applies on this layout, in the manifest's record
        from megatron_bitdet.train.step_fingerprints import ddp_buffers

        grad_bytes = sum(g.numel() * g.element_size() for g in ddp_buffers(state.ddp_modules, "grad_data"))
        installed["virtual_layout"] = state.virtual.record(grad_bytes)
    return state
