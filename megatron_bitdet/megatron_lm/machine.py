"""What this machine cannot run: every flag or Megatron default of a launch line that needs an extension
(or a CUDA device) absent here, each with the flag that turns it off or the package that provides it.

Judged on Megatron's *validated* args (``validate_args`` has derived its defaults: RoPE fusion off where it
turns it off, CUDA graphs resolved to ``cuda_graph_impl``), before any rank starts: a launch line that would
die inside the ranks, one traceback per try, is refused once, listing every flag to add or drop. This is
apart from the determinism violations: a flag can be both (then each section names it).

Without Transformer Engine every module megatron-core builds takes its local path, so the local path's
Apex kernels are judged whatever the spec (the TE spec's own row says to switch to the local one). What is
built is decided as Megatron-LM's builders decide it: a ``--spec`` (every Mamba stack has one) builds what it
holds, as the spec walk reads it, and ``--transformer-impl`` is read only where there is none (pretrain_gpt.py's
own specs).
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from megatron_bitdet.compat.extensions import imports, te_here
from megatron_bitdet.megatron_lm.validate import HYBRID_SCRIPTS

LOCAL_MAMBA_SPEC = "--spec megatron_bitdet.megatron_lm.specs local_mamba_stack_spec"
TE_MAMBA_SPEC = "--spec megatron_bitdet.megatron_lm.specs te_mamba_stack_spec"


@dataclass(frozen=True)
class Missing:
    what: str    # the flag or default that asks for it
    needs: str   # what is absent here
    fix: str     # the flag to add / drop, or the package to install

    def __str__(self) -> str:
        return f"{self.what}: needs {self.needs}; fix: {self.fix}"


def _have(name: str) -> bool:
    return importlib.util.find_spec(name) is not None and imports(name)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _spec_family(spec) -> str | None:
    """'te' / 'local' for a ``--spec`` object (None: no --spec), as the audit reads it off the spec."""
    if spec is None:
        return None
    from megatron_bitdet.enforce.audit import recipe_keys

    return recipe_keys(spec).get("model.spec")


def _fused_softmax_asked(a) -> bool:
    """megatron-core's FusedScaleMaskSoftmax asks for its CUDA kernel (and dies without it) only at the shapes
    its ``is_kernel_available`` takes: 16 < seq <= 4096, seq and micro-batch x heads per TP rank divisible by 4;
    elsewhere it runs torch's softmax (the local attention has no context parallelism: seq is the line's)."""
    get = lambda name: getattr(a, name, None) or 0  # noqa: E731
    seq, heads = get("seq_length"), get("num_attention_heads") // (get("tensor_model_parallel_size") or 1)
    return 16 < seq <= 4096 and seq % 4 == 0 and get("micro_batch_size") * heads % 4 == 0


def missing(a, spec, script: str, pattern: str) -> list[Missing]:
    """Every row for the validated args ``a`` (the flags as the model config will get them), the ``--spec``
    object (None without), the script's file name and the layer pattern (``M*-E`` symbols)."""
    te, cuda, out = te_here(), _cuda(), []
    get = lambda name, default=None: getattr(a, name, default)  # noqa: E731
    mamba = script in HYBRID_SCRIPTS
    family = _spec_family(spec)
    if mamba and spec is None and get("transformer_impl") != "inference_optimized":
        out.append(Missing(f"{script} without --spec", "a layer spec (Megatron-LM builds no default Mamba stack: "
                           "its builder raises 'You must provide a valid ... layer spec via --spec')",
                           f"add {TE_MAMBA_SPEC}" if te else
                           f"add {LOCAL_MAMBA_SPEC} (Transformer Engine is absent here)"))
    if not te:
        if family == "te":
            out.append(Missing(f"--spec {' '.join(get('spec'))}", "Transformer Engine (the spec builds TE modules)",
                               f"use {LOCAL_MAMBA_SPEC}" if mamba else
                               "a spec of megatron-core's local modules, or install transformer_engine"))
        if get("transformer_impl") == "transformer_engine" and spec is None and not mamba:  # else the spec builds
            out.append(Missing("--transformer-impl transformer_engine (Megatron's default)", "Transformer Engine",
                               "add --transformer-impl local"))
        if get("position_embedding_type") in ("rope", "yarn", "mrope") and get("apply_rope_fusion"):
            out.append(Missing("RoPE fusion (on by default with rope)", "Transformer Engine's fused RoPE",
                               "add --no-rope-fusion"))
        # --fp8-format with the local spec is no row: without TE megatron-core's FP8 context is a nullcontext and
        # the local linears train in the line's dtype, so the line is refused on any machine (args.fp8_issue).
        # Where the line builds TE's modules, the row above switches them to the local ones, and FP8 must go too
        local = family == "local" if spec is not None else not mamba and get("transformer_impl") == "local"
        if get("fp8") and not local:
            out.append(Missing(f"--fp8-format {a.fp8}", "Transformer Engine (megatron-core's FP8 is TE's autocast; "
                               "the local modules this machine builds instead have no FP8 path)",
                               "drop --fp8-format" + "; drop --fp8-param-gather" * bool(get("fp8_param_gather"))
                               + " (FP8 on CPU: bitdet's emulation, bitdet verify-resume --recipe "
                               "recipes/nemotron_h_tiny_fp8.yaml)"))
        # --te-rng-tracker is no row: without TE megatron-core builds its own tracker (``HAVE_TE and use_te_rng_tracker``)
        for flag in ("moe_permute_fusion", "moe_router_fusion", "tp_comm_overlap"):
            if get(flag):
                out.append(Missing(f"--{flag.replace('_', '-')}", "Transformer Engine",
                                   f"drop --{flag.replace('_', '-')}"))
        layers = importlib.import_module("megatron.core.tensor_parallel.layers")
        if get("gradient_accumulation_fusion") and not layers._grad_accum_fusion_available:
            out.append(Missing("gradient-accumulation fusion (on by default)", "Apex's fused_weight_gradient_mlp_cuda",
                               "add --no-gradient-accumulation-fusion (or install Apex with its CUDA extensions)"))
        if "*" in pattern and get("masked_softmax_fusion") and (get("bf16") or get("fp16")) \
                and _fused_softmax_asked(a) and not _have("scaled_masked_softmax_cuda"):
            out.append(Missing("masked-softmax fusion (on by default) with --bf16/--fp16",
                               "Megatron's scaled_masked_softmax_cuda", "add --no-masked-softmax-fusion"))
        if not mamba and spec is None and not _have("apex"):  # the local GPT spec's norm: WrappedTorchNorm's asserts
            for on, what, fix in ((not get("no_persist_layer_norm"), "persistent layer norm (on by default)",
                                   "add --no-persist-layer-norm"),
                                  (get("layernorm_zero_centered_gamma"), "--apply-layernorm-1p",
                                   "drop --apply-layernorm-1p"),
                                  (get("sequence_parallel"), "--sequence-parallel", "drop --sequence-parallel")):
                if on:
                    out.append(Missing(what, "Apex (megatron-core's local spec falls back to WrappedTorchNorm, which "
                                       "refuses it)", fix))
    # --use-flash-attn / --attention-backend flash are no row: megatron-core's local attention never calls
    # flash-attn (the backend only sets TE's NVTE_* variables); a TE spec has its own row; in deterministic mode
    # both are a determinism violation (flash_attention)
    if get("moe_token_dispatcher_type") == "flex":
        hybrid = get("moe_flex_dispatcher_backend") == "hybridep"
        if not (cuda and _have("deep_ep") and hasattr(importlib.import_module("deep_ep"),
                                                      "HybridEPBuffer" if hybrid else "Buffer")):
            out.append(Missing("--moe-token-dispatcher-type flex", f"{'HybridEP' if hybrid else 'DeepEP'} on a GPU "
                               "(megatron-core's flex dispatcher builds its deep_ep buffer)",
                               "use --moe-token-dispatcher-type alltoall"))
    if not cuda:
        if get("batch_invariant_mode"):
            out.append(Missing("--batch-invariant-mode", "megatron-core's Triton kernels on a GPU (Megatron-LM's "
                               "initialize_megatron turns them on before the model is built; their module imports "
                               "Triton)", "drop --batch-invariant-mode"))
        if get("cuda_graph_impl", "none") != "none":
            out.append(Missing(f"CUDA graphs (--cuda-graph-impl {a.cuda_graph_impl})", "a CUDA device (Megatron-LM "
                               "asks megatron-core's RNG tracker for graph-safe states, which needs PyTorch's CUDA "
                               "graphs)", "drop --cuda-graph-impl / --enable-cuda-graph / --external-cuda-graph"))
        if get("async_save") and get("use_persistent_ckpt_worker"):  # validate_args drops --async-save without it
            out.append(Missing("--async-save --use-persistent-ckpt-worker", "a CUDA device (the persistent "
                               "checkpoint worker picks one: rank % torch.cuda.device_count())", "drop --use-persistent-ckpt-worker (Megatron then "
                               "turns --async-save off and saves synchronously)"))
        copy = "a CUDA device (megatron-core's LanguageModule moves the last stage's embedding copy with .cuda())"
        if (get("pipeline_model_parallel_size") or 1) > 1:
            if not get("untie_embeddings_and_output_weights"):
                out.append(Missing("tied embeddings (Megatron's default) at --pipeline-model-parallel-size "
                                   f"{a.pipeline_model_parallel_size}", copy,
                                   "add --untie-embeddings-and-output-weights"))
            if get("mtp_num_layers"):
                out.append(Missing(f"--mtp-num-layers {a.mtp_num_layers} at --pipeline-model-parallel-size "
                                   f"{a.pipeline_model_parallel_size}", copy, "drop --mtp-num-layers"))
        iters, start = get("train_iters"), get("profile_step_start", 0)  # train_iters None: samples-based
        if get("profile") and not get("use_pytorch_profiler") and (iters is None or iters > start):
            out.append(Missing(f"--profile (Nsight, from --profile-step-start {start})", "a CUDA device (Megatron-LM's "
                               "train loop calls torch.cuda.cudart().cudaProfilerStart() there)", "drop --profile"))
        if get("moe_grouped_gemm"):
            out.append(Missing("--moe-grouped-gemm (not swapped)", "a CUDA device (Megatron-LM's validate_args "
                               "reads its compute capability)", "drop --moe-grouped-gemm"))
    return out


def section(rows: list[Missing]) -> str:
    """The ``--check`` section (and the pre-launch refusal) listing every row."""
    return "will not run on this machine:\n" + "\n".join(f"  {row}" for row in rows)
