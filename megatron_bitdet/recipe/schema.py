"""The recipe schema: one frozen dataclass per YAML section, attribute names = YAML keys.

``_checks`` methods hold the derived constraints (divisibility, pattern symbols, ...); they run only when
the section's own fields are well typed, and yield ``(key path relative to the section, message)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_bitdet.recipe.typed import bounded, checked

PATTERN_SYMBOLS = {"M": "Mamba-2", "*": "attention", "-": "MLP", "E": "MoE"}


def _pattern_issue(pattern: str):
    bad = sorted(set(pattern) - set(PATTERN_SYMBOLS))
    if bad or not pattern:
        allowed = ", ".join(f"{s} ({n})" for s, n in PATTERN_SYMBOLS.items())
        return f"symbols {bad or 'none'} not supported; allowed: {allowed}"
    return None


def te_fp8_grouped_issue(model, family: str):
    """bitdet's GroupedProbMLP refuses config.fp8: TE's FP8 recipe with ``expert_impl: grouped`` cannot
    build. ``family``: the resolved spec family (``auto``: not known yet, only an explicit te counts)."""
    impl = model.fp8.implementation if model.fp8.implementation != "auto" else ("te" if family == "te" else None)
    if model.has("E") and model.moe.expert_impl == "grouped" and model.fp8.recipe != "none" and impl == "te":
        return (f"grouped (bitdet's GroupedProbMLP has no FP8 path) cannot build with model.fp8.recipe: "
                f"{model.fp8.recipe} under Transformer Engine (model.fp8.implementation: {model.fp8.implementation}, "
                f"spec {family}); use model.moe.expert_impl: sequential, or model.fp8.implementation: emulated")
    return None


def _divides(a_key, a, b_key, b):
    """Reported at the divisor's key: it is usually the knob that was just changed."""
    if a and b and b % a:
        yield a_key, f"{a} does not divide {b_key} ({b})"


@dataclass(frozen=True)
class MambaConfig:
    num_heads: int = bounded(8, ge=1)
    head_dim: int = bounded(64, ge=1)
    state_dim: int = bounded(128, ge=1)
    num_groups: int = bounded(8, ge=1)
    chunk_size: int = bounded(128, ge=1)
    conv_kernel: int = bounded(4, ge=1, le=8)  # causal_conv1d supports widths 2..4; torch any small width

    def _checks(self):
        yield from _divides("num_groups", self.num_groups, "mamba.num_heads", self.num_heads)


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = bounded(0, ge=0)
    top_k: int = bounded(2, ge=1)
    ffn_hidden_size: Optional[int] = bounded(None, ge=1)
    shared_expert_ffn_hidden_size: Optional[int] = bounded(None, ge=1)
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    router_expert_bias: bool = False
    load_balancing: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"
    aux_loss_coeff: float = bounded(0.0, ge=0.0)
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    # sequential: megatron SequentialMLP; grouped: bitdet deterministic grouped GEMM;
    # te_grouped: megatron TEGroupedMLP (moe_grouped_gemm) whose dprob epilogue uses atomics.
    expert_impl: Literal["sequential", "grouped", "te_grouped"] = "sequential"
    # the kernels behind expert_impl: grouped — torch (any device) or triton (kernels/triton_grouped.py:
    # a CUDA device and the triton package; squared ReLU only)
    grouped_backend: Literal["torch", "triton"] = "torch"
    router_fusion: bool = False   # TE fused top-k + aux loss (atomicAdd across CTAs)
    permute_fusion: bool = False  # TE fused permute / unpermute (bypasses megatron's index_add_ branch)


@dataclass(frozen=True)
class FP8Config:
    """FP8 training. On GPU with Transformer Engine: TE's recipe (megatron's fp8 / fp8_recipe / ...);
    elsewhere an emulated FP8 linear (quantize, compute on dequantized values) in the local spec."""

    recipe: Literal["none", "delayed", "tensorwise", "mxfp8"] = "none"
    format: Literal["e4m3", "hybrid"] = "hybrid"  # hybrid: e4m3 forward, e5m2 output gradients
    amax_history_len: int = bounded(16, ge=1)
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    margin: int = bounded(0, ge=0)
    implementation: Literal["auto", "te", "emulated"] = "auto"  # auto: te with the TE spec, else emulated


@dataclass(frozen=True)
class FP4Config:
    """NVFP4 training after NVIDIA's recipe (arXiv 2509.25149). On GPU with Transformer Engine >= 2.7:
    TE's NVFP4BlockScaling (megatron's fp4 / fp4_recipe); elsewhere an emulated NVFP4 linear in the
    local spec (``kernels/fp4_linear.py``). Each part of the recipe can be switched off."""

    recipe: Literal["none", "nvfp4"] = "none"
    format: Literal["e2m1"] = "e2m1"
    weight_2d_scaling: bool = True     # 16x16 weight blocks (off: 1x16, re-quantized for dgrad)
    hadamard: bool = True              # random Hadamard transform on the wgrad GEMM's inputs
    hadamard_seed: int = bounded(0, ge=0)  # draws the transform's sign vector
    stochastic_rounding: bool = True   # gradients rounded stochastically, from the layer's own generator
    implementation: Literal["auto", "te", "emulated"] = "auto"  # auto: te with the TE spec, else emulated


@dataclass(frozen=True)
class ModelConfig:
    hybrid_pattern: str = checked(_pattern_issue)
    hidden_size: int = bounded(ge=1)
    ffn_hidden_size: int = bounded(ge=1)
    num_attention_heads: int = bounded(ge=1)
    seq_length: int = bounded(ge=1)
    vocab_size: int = bounded(ge=1)
    num_query_groups: Optional[int] = bounded(None, ge=1)
    kv_channels: Optional[int] = bounded(None, ge=1)  # attention head dim; default hidden / heads
    activation: Literal["squared_relu", "gelu", "swiglu", "relu"] = "squared_relu"
    add_bias_linear: bool = False
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    position_embedding: Literal["none", "rope", "learned_absolute"] = "none"
    hidden_dropout: float = bounded(0.0, ge=0.0, lt=1.0)
    attention_dropout: float = bounded(0.0, ge=0.0, lt=1.0)
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    spec: Literal["auto", "local", "te"] = "auto"
    # Megatron's --attention-backend; flash has no deterministic backward in megatron-core 0.16.1
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = "auto"
    mtp_num_layers: int = bounded(0, ge=0)
    cross_entropy_loss_fusion: bool = False
    mamba: MambaConfig = field(default_factory=MambaConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    fp4: FP4Config = field(default_factory=FP4Config)

    @property
    def num_layers(self) -> int:
        return len(self.hybrid_pattern)

    def has(self, symbol: str) -> bool:
        return symbol in self.hybrid_pattern

    def _checks(self):
        yield from _divides("num_attention_heads", self.num_attention_heads, "model.hidden_size", self.hidden_size)
        yield from _divides("num_query_groups", self.num_query_groups, "model.num_attention_heads",
                            self.num_attention_heads)
        if self.has("E"):
            if self.moe.num_experts == 0:
                yield "moe.num_experts", "the pattern has MoE layers (E) but moe.num_experts is 0"
            elif self.moe.top_k > self.moe.num_experts:
                yield "moe.top_k", f"{self.moe.top_k} exceeds moe.num_experts ({self.moe.num_experts})"
            if self.moe.ffn_hidden_size is None:
                yield "moe.ffn_hidden_size", "required when the pattern has MoE layers (E)"
        if self.fp4.recipe != "none" and self.fp8.recipe != "none":
            yield "fp4.recipe", (f"{self.fp4.recipe} and model.fp8.recipe: {self.fp8.recipe} are both on; "
                                 "a linear computes in one of them (megatron refuses fp4 with fp8 too)")
        issue = te_fp8_grouped_issue(self, self.spec)
        if issue:
            yield "moe.expert_impl", issue
        if self.moe.grouped_backend != "torch" and self.moe.expert_impl != "grouped":
            yield "moe.grouped_backend", (f"{self.moe.grouped_backend} selects the kernels of expert_impl: grouped, "
                                          f"but model.moe.expert_impl is {self.moe.expert_impl}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor: int = bounded(1, ge=1)
    pipeline: int = bounded(1, ge=1)
    expert: int = bounded(1, ge=1)
    expert_tensor: int = bounded(1, ge=1)
    context: int = bounded(1, ge=1)
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    tp_comm_overlap: bool = False  # TE userbuffers GEMM+comm overlap; refused in deterministic mode
    overlap_grad_reduce: bool = False  # DDP's bucket reductions launched during the backward
    overlap_param_gather: bool = False  # the distributed optimizer's all-gather waited on by the forward

    def _checks(self):
        if self.overlap_param_gather and not (self.distributed_optimizer and self.overlap_grad_reduce):
            yield "overlap_param_gather", ("needs distributed_optimizer: true and overlap_grad_reduce: true (as "
                                           "Megatron-LM's validate_args)")


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["adam", "sgd"] = "adam"
    lr: float = bounded(3e-4, gt=0.0)
    min_lr: float = bounded(0.0, ge=0.0)
    weight_decay: float = bounded(0.0, ge=0.0)
    beta1: float = bounded(0.9, ge=0.0, lt=1.0)
    beta2: float = bounded(0.95, ge=0.0, lt=1.0)
    eps: float = bounded(1e-8, gt=0.0)
    clip_grad: float = bounded(1.0, ge=0.0)

    def _checks(self):
        if self.min_lr > self.lr:
            yield "min_lr", f"{self.min_lr} exceeds lr ({self.lr})"


@dataclass(frozen=True)
class LRScheduleConfig:
    style: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_iters: int = bounded(0, ge=0)


@dataclass(frozen=True)
class TrainingConfig:
    iterations: int = bounded(10, ge=1)
    micro_batch_size: int = bounded(1, ge=1)
    global_batch_size: int = bounded(1, ge=1)
    seed: int = bounded(1234, ge=0)
    log_interval: int = bounded(1, ge=1)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)

    def _checks(self):
        yield from _divides("micro_batch_size", self.micro_batch_size, "training.global_batch_size",
                            self.global_batch_size)


@dataclass(frozen=True)
class DataConfig:
    corpus: str = "python-stdlib"
    tokenizer: Literal["byte"] = "byte"
    cache_dir: Optional[str] = None
    split: str = "98,1,1"

    def _checks(self):
        parts = self.split.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts) or not any(int(p) for p in parts):
            yield "split", f"{self.split!r} must be three non-negative integers 'train,valid,test'"


@dataclass(frozen=True)
class CheckpointConfig:
    format: Literal["torch_dist"] = "torch_dist"
    save_interval: int = bounded(0, ge=0)


@dataclass(frozen=True)
class DeterminismConfig:
    mode: bool = True
    threads: Optional[int] = bounded(None, ge=1)  # torch intra-op threads; None = leave (still recorded)
    # Off by default: torch's NaN fill of torch.empty is ~all of the upstream tax on CPU; reads of
    # uninitialized memory are caught by the repeat-and-compare kernel tests and the op traces instead.
    fill_uninitialized_memory: bool = False
    env: dict[str, str] = field(default_factory=dict)
    opt_out: tuple[str, ...] = ()
    swaps: bool = True  # let registered deterministic variants replace refused features
    # native: c10d's reductions (bits follow the ring/tree the library and allocation pick);
    # topology_invariant: exact shard movement + rank-order sums (bits follow the logical layout only)
    # dp_invariant: the gradients and scalars of a fixed virtual layout of virtual_dp data-parallel ranks,
    # hosted by any physical DP dividing it (bits independent of the data-parallel size)
    reductions: Literal["native", "topology_invariant", "dp_invariant"] = "native"
    virtual_dp: Optional[int] = bounded(None, ge=1)

    def virtual_dp_issue(self, dp: int) -> str | None:
        """Why a data-parallel size ``dp`` cannot host the virtual layout (None: it can)."""
        if self.reductions == "dp_invariant" and self.virtual_dp % dp:
            return (f"determinism.virtual_dp={self.virtual_dp} is not divisible by the data-parallel size {dp}: "
                    "a rank hosts virtual_dp / DP virtual ranks (use a DP that divides it)")
        return None

    def _checks(self):
        v = self.virtual_dp
        if self.reductions == "dp_invariant" and v is None:
            yield "virtual_dp", "is required with reductions: dp_invariant (the data-parallel size it reproduces)"
        elif v is not None and self.reductions != "dp_invariant":
            yield "virtual_dp", f"is only read with reductions: dp_invariant (reductions is {self.reductions})"
        elif v is not None and v & (v - 1):
            yield "virtual_dp", f"{v} is not a power of two (the gradient tree and its 1/V scaling need one)"


@dataclass(frozen=True)
class RecipeConfig:
    name: str
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    determinism: DeterminismConfig = field(default_factory=DeterminismConfig)

    def _checks(self):
        m, p = self.model, self.parallel
        yield from _divides("parallel.tensor", p.tensor, "model.num_attention_heads", m.num_attention_heads)
        yield from _divides("parallel.tensor", p.tensor, "model.num_query_groups", m.num_query_groups)
        if m.has("M"):
            yield from _divides("parallel.tensor", p.tensor, "model.mamba.num_heads", m.mamba.num_heads)
            yield from _divides("parallel.tensor", p.tensor, "model.mamba.num_groups", m.mamba.num_groups)
        if m.has("E"):
            yield from _divides("parallel.expert", p.expert, "model.moe.num_experts", m.moe.num_experts)
        elif p.expert > 1:
            yield "parallel.expert", f"{p.expert} > 1 but the pattern has no MoE layers (E)"
        if p.pipeline > m.num_layers:
            yield "parallel.pipeline", f"{p.pipeline} stages exceed the {m.num_layers} layers"
        d, t = self.determinism, self.training
        if d.reductions == "dp_invariant" and d.virtual_dp:
            if t.global_batch_size % (t.micro_batch_size * d.virtual_dp):
                yield "determinism.virtual_dp", (f"{d.virtual_dp} x training.micro_batch_size {t.micro_batch_size} "
                                                 f"does not divide training.global_batch_size {t.global_batch_size}")
            if m.has("E") and m.moe.load_balancing == "global_aux_loss":
                yield "determinism.reductions", ("dp_invariant cannot host global_aux_loss: its token counts are "
                                                 "all-reduced across DP inside each micro-batch's forward")
            if m.fp8.recipe == "delayed":
                yield "determinism.reductions", ("dp_invariant cannot host model.fp8.recipe: delayed: the amax "
                                                 "history rolls once per micro-batch a rank runs")
