"""Test-only module workers (importable via PYTHONPATH=tests): a hybrid block (Mamba, attention, MoE)
built in fp32, bf16, emulated FP8 and emulated NVFP4 on one parallel layout, run forward + backward
twice from a restored RNG state, every output and gradient saved for the test to compare byte for byte."""
from pathlib import Path

import torch

from megatron_bitdet.train.worker import enforce

def _run_once(state, batch, captured):
    """One forward + backward through megatron's schedule; returns (outputs, gradients) of this rank."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_bitdet.train.step_fingerprints import ddp_buffers

    captured.clear()
    for m in state.ddp_modules:
        m.zero_grad_buffer()

    def loss_func(output):
        captured.append(output.detach().clone())
        return output.float().sum(), {}

    def forward_step(iterator, model):
        b = next(iterator)
        return model(b["tokens"], b["position_ids"], None, labels=b["labels"]), loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([batch]), model=state.ddp_modules, num_microbatches=1,
        seq_length=batch["tokens"].shape[1], micro_batch_size=batch["tokens"].shape[0], forward_only=False,
    )
    grads = {f"{i}.{n}": p.main_grad.detach().clone()
             for i, m in enumerate(state.ddp_modules) for n, p in m.module.named_parameters()}
    grads["ddp.grad_data"] = torch.cat([b.float().reshape(-1) for b in ddp_buffers(state.ddp_modules, "grad_data")])
    return [*captured], grads


def hybrid_block(rank, world_size, *, recipe, layouts, out):
    """For each parallel layout (name -> precision variants, recipe dicts; ``recipe`` is enforced) and
    each precision variant: build, capture RNG (and the module buffers: FP8 scaling state), run,
    restore both, run again, run a third time without restoring (dropout draws anew: must differ).
    The layouts run one after another in this process, megatron's parallel state torn down between."""
    from megatron.core import parallel_state as ps

    from megatron_bitdet.compat import cpu_backend
    from megatron_bitdet.recipe import Recipe
    from megatron_bitdet.train.setup import init_parallel

    cpu_backend.install()
    results = {}
    for layout, variants in layouts.items():
        init_parallel(Recipe.from_dict(next(iter(variants.values())), source=f"<module test {layout}>"))
        results[layout] = {name: _precision(Recipe.from_dict(data, source=f"<module test {layout} {name}>"))
                           for name, data in variants.items()}
        ps.destroy_model_parallel()
    torch.save(results, Path(out) / f"rank_{rank}.pt")


def _precision(r) -> dict:
    """One precision variant on the current parallel layout: first / again (RNG, buffers and the model's
    own generators restored) / fresh; with NVFP4's stochastic rounding also ``sr_only``: everything
    restored but the layers' rounding generators."""
    from megatron_bitdet.compat import patching
    from megatron_bitdet.model.builder import default_model_provider, resolve_spec_family
    from megatron_bitdet.train.checkpoint import capture_rng, restore_rng
    from megatron_bitdet.train.module_state import capture_module_rng, restore_module_rng
    from megatron_bitdet.train.setup import build_trainable

    ids = patching.select_patches(r, family=resolve_spec_family(r))
    with patching.patched(patching.load_declarations(ids=ids)):
        state = build_trainable(r, swaps=[], provider=default_model_provider)
        m = r.model
        g = torch.Generator().manual_seed(17)  # the same tokens on every rank (TP / PP need that)
        tokens = torch.randint(0, m.vocab_size, (r.training.micro_batch_size, m.seq_length), generator=g)
        batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1),
                 "position_ids": torch.arange(m.seq_length).expand_as(tokens)}
        captured = []
        model = state.ddp_modules[0].module
        model = getattr(model, "module", model)  # under megatron's Float16Module in bf16
        model.decoder.register_forward_hook(
            lambda mod, args, output: captured.append(output.detach().clone()))
        chunks = [m.module for m in state.ddp_modules]
        rng, generators = capture_rng(), capture_module_rng(chunks)
        buffers = [b.clone() for c in chunks for b in c.buffers()]  # FP8 scaling state, NVFP4 encodings

        def restore(with_generators=True):
            restore_rng(rng)
            for b, saved in zip((b for c in chunks for b in c.buffers()), buffers):
                b.copy_(saved)
            if with_generators:
                restore_module_rng(chunks, generators, source="<module test>")

        first = _run_once(state, batch, captured)
        restore()
        again = _run_once(state, batch, captured)
        fresh = _run_once(state, batch, captured)
        sr_only = None
        if generators:
            restore(with_generators=False)
            sr_only = _run_once(state, batch, captured)
    modules = list(state.ddp_modules[0].module.modules())
    return {"first": first, "again": again, "fresh": fresh, "sr_only": sr_only, "generators": sorted(generators),
            "dtypes": sorted({str(p.dtype) for p in state.ddp_modules[0].module.parameters()}),
            "fp8_linears": sum(hasattr(mod, "fp8_amax_history") for mod in modules),
            "fp4_linears": sum(hasattr(mod, "fp4_weight_values") for mod in modules)}


hybrid_block.before_process_group = enforce
