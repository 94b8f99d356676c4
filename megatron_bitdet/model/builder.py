"""The hybrid Nemotron builder: a recipe becomes megatron-core's ``MambaModel``.

``default_model_provider`` has the signature every provider shares (``--model-provider
MODULE:FUNC`` loads one): ``provider(recipe, config, *, pre_process, post_process) -> module``.
A custom provider may call the default and modify what it returns, as Megatron's
``model_provider`` does.
"""
from __future__ import annotations

import importlib
import inspect

import torch
import torch.nn.functional as F

from megatron_bitdet.errors import BitdetError, BitdetInputError

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "swiglu": F.silu}


def resolve_spec_family(recipe) -> str:
    """``auto`` means TE when it imports and a GPU is present, else the local pure-torch spec."""
    from megatron_bitdet.compat.extensions import te_here

    family = recipe.model.spec
    if family == "auto":
        return "te" if torch.cuda.is_available() and te_here() else "local"
    if family == "te" and not te_here():
        raise BitdetError("model.spec=te needs Transformer Engine, which does not import here; use model.spec=local")
    return family


def _low_precision_implementation(recipe, section: str) -> str | None:
    """None (``model.<section>.recipe: none``), "te" (Transformer Engine's recipe, TE spec) or
    "emulated" (the local spec's emulated linears: patch ``<section>_emulated_linear``)."""
    cfg, family = getattr(recipe.model, section), resolve_spec_family(recipe)
    if cfg.recipe == "none":
        return None
    impl = cfg.implementation if cfg.implementation != "auto" else ("te" if family == "te" else "emulated")
    if (impl == "te") != (family == "te"):
        raise BitdetError(f"model.{section}.implementation={impl} needs model.spec={'te' if impl == 'te' else 'local'} "
                          f"(the resolved spec is {family})")
    return impl


def fp8_implementation(recipe) -> str | None:
    """FP8's implementation (``_low_precision_implementation``); TE's FP8 with grouped experts refused."""
    from megatron_bitdet.recipe.schema import te_fp8_grouped_issue

    if recipe.model.fp8.recipe != "none":
        issue = te_fp8_grouped_issue(recipe.model, resolve_spec_family(recipe))
        if issue:
            raise BitdetInputError(f"{recipe.where('model', 'moe', 'expert_impl')}: model.moe.expert_impl: {issue}")
    return _low_precision_implementation(recipe, "fp8")


def fp4_implementation(recipe) -> str | None:
    """NVFP4's implementation (``_low_precision_implementation``). Under TE, megatron-core 0.16.1 builds
    ``NVFP4BlockScaling()`` with TE's defaults (every part of the recipe on): a recipe that switches a
    part off is refused there rather than silently run with it on."""
    impl = _low_precision_implementation(recipe, "fp4")
    f = recipe.model.fp4
    if impl == "te" and not (f.weight_2d_scaling and f.hadamard and f.stochastic_rounding):
        raise BitdetInputError(f"{recipe.where('model', 'fp4')}: model.fp4: megatron-core 0.16.1 builds TE's "
                               "NVFP4BlockScaling() with every part on; weight_2d_scaling, hadamard and "
                               "stochastic_rounding must be true under Transformer Engine (or use "
                               "model.fp4.implementation: emulated with model.spec: local)")
    return impl


def transformer_config(recipe, *, swapped=(), use_cpu_initialization: bool | None = None):
    """megatron TransformerConfig for the recipe, carrying the enforcement's determinism decisions
    (``swapped``: rule ids the enforcement resolved with a swap)."""
    from megatron.core.activations import squared_relu
    from megatron.core.transformer import TransformerConfig

    from megatron_bitdet.enforce import megatron_overrides

    m, par, moe = recipe.model, recipe.parallel, recipe.model.moe
    if m.mtp_num_layers:
        raise BitdetError("model.mtp_num_layers > 0: megatron-core 0.16.1's MambaModel has no multi-token prediction")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[m.params_dtype]
    kwargs = dict(
        num_layers=len(m.hybrid_pattern),
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        add_bias_linear=m.add_bias_linear,
        normalization=m.normalization,
        activation_func=squared_relu if m.activation == "squared_relu" else ACTIVATIONS[m.activation],
        gated_linear_unit=m.activation == "swiglu",
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=par.tensor,
        pipeline_model_parallel_size=par.pipeline,
        expert_model_parallel_size=par.expert,
        expert_tensor_parallel_size=par.expert_tensor,
        context_parallel_size=par.context,
        sequence_parallel=par.sequence_parallel,
        mamba_num_heads=m.mamba.num_heads,
        mamba_head_dim=m.mamba.head_dim,
        mamba_state_dim=m.mamba.state_dim,
        mamba_num_groups=m.mamba.num_groups,
        use_mamba_mem_eff_path=False,
        use_cpu_initialization=not torch.cuda.is_available() if use_cpu_initialization is None else use_cpu_initialization,
        pipeline_dtype=dtype,
    )
    if moe.num_experts:
        kwargs.update(
            num_moe_experts=moe.num_experts,
            moe_router_topk=moe.top_k,
            moe_ffn_hidden_size=moe.ffn_hidden_size or m.ffn_hidden_size,
            moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
            moe_router_score_function=moe.router_score_function,
            moe_router_enable_expert_bias=moe.router_expert_bias,
            moe_router_load_balancing_type=moe.load_balancing,
            moe_aux_loss_coeff=moe.aux_loss_coeff,
            moe_token_dispatcher_type=moe.dispatcher,
        )
    fp8 = fp8_implementation(recipe)
    if fp8 == "te":
        f = m.fp8
        kwargs.update(fp8=f.format, fp8_recipe=f.recipe, fp8_margin=f.margin,
                      fp8_amax_history_len=f.amax_history_len, fp8_amax_compute_algo=f.amax_compute_algo)
    fp4 = fp4_implementation(recipe)
    if fp4 == "te":
        kwargs.update(fp4=m.fp4.format, fp4_recipe=m.fp4.recipe)
    kwargs.update(megatron_overrides(recipe, swapped))
    config = TransformerConfig(**kwargs)
    if fp8 == "emulated":  # megatron's own fp8 fields would route to TE; the emulated linears read this
        config.emulated_fp8 = m.fp8
    if fp4 == "emulated":  # likewise megatron's fp4 fields
        config.emulated_fp4 = m.fp4
    return config


def padded_vocab_size(recipe) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x TP so every TP shard is equal."""
    multiple = 128 * recipe.parallel.tensor
    return -(-recipe.model.vocab_size // multiple) * multiple


def stack_spec(recipe, *, grouped_gemm: bool = False):
    """The layer spec for the recipe's family, with the recipe's Mamba kernel parameters.
    ``grouped_gemm``: TE grouped-GEMM experts (the config's moe_grouped_gemm: te_grouped, not swapped)."""
    from megatron_bitdet.compat import builders
    from megatron_bitdet.model import specs

    family = resolve_spec_family(recipe)
    kwargs = dict(num_experts=recipe.model.moe.num_experts,
                  mamba_params={"chunk_size": recipe.model.mamba.chunk_size, "d_conv": recipe.model.mamba.conv_kernel})
    if family == "te":
        spec = specs.te_stack_spec(**kwargs, grouped_gemm=grouped_gemm)
    else:
        spec = specs.local_stack_spec(**kwargs, expert_impl=recipe.model.moe.expert_impl)
    backend = recipe.model.moe.grouped_backend
    if backend != "torch" and recipe.model.moe.num_experts:
        from megatron_bitdet.kernels.grouped_mlp import GroupedMLPConfig, backend_unavailable

        reason = backend_unavailable(backend)
        if reason:
            raise BitdetInputError(f"{recipe.where('model', 'moe', 'grouped_backend')}: model.moe.grouped_backend: "
                                   f"{backend} cannot run here: {reason}; use torch")
        moe = builders.submodules_of(spec.submodules.moe_layer.submodules.mlp)
        moe.experts = builders.rebuilt(moe.experts, kernel_config=GroupedMLPConfig(backend=backend))
    return spec


def default_model_provider(recipe, config, *, pre_process: bool = True, post_process: bool = True):
    """Build this pipeline stage of the hybrid Mamba/attention/MLP/MoE model."""
    from megatron.core.models.mamba.mamba_model import MambaModel

    return MambaModel(
        config=config,
        mamba_stack_spec=stack_spec(recipe, grouped_gemm=bool(config.moe_grouped_gemm)),
        vocab_size=padded_vocab_size(recipe),
        max_sequence_length=recipe.model.seq_length,
        hybrid_override_pattern=recipe.model.hybrid_pattern,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type=recipe.model.position_embedding,
        share_embeddings_and_output_weights=False,
    )


def load_model_provider(spec: str | None):
    """Resolve ``MODULE:FUNC`` to a provider callable; a clear error for every way it can be wrong."""
    if not spec:
        return default_model_provider
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BitdetInputError(f"--model-provider {spec!r}: expected MODULE:FUNC, e.g. my_models.nemotron:provider")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BitdetInputError(f"--model-provider {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise BitdetInputError(f"--model-provider {spec!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise BitdetInputError(f"--model-provider {spec!r}: {attr!r} is not callable")
    try:
        inspect.signature(fn).bind(None, None, pre_process=True, post_process=True)
    except TypeError as exc:
        raise BitdetInputError(
            f"--model-provider {spec!r}: {attr} must accept (recipe, config, *, pre_process, post_process): {exc}"
        ) from exc
    return fn
