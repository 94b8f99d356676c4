"""The seams between megatron-core and a CPU-only torch, one function per seam (docs/COMPAT.md).

Each seam says what breaks without it. They are installed once per process, before the model is
built; nothing here runs per step except the no-op stand-ins megatron calls (synchronize, events).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
import textwrap
import types
import time

import torch
from packaging.specifiers import SpecifierSet

from megatron_bitdet.compat.rebind import rebind
from megatron_bitdet.compat.versions import megatron_core_version, require_supported, supports
from megatron_bitdet.errors import BitdetError

_INSTALLED: list[str] = []
_EAGER: list[str] = []  # eager_jit_fuser, when it applied in this process
DYNAMO_OFF = "TORCHDYNAMO_DISABLE"


def installed() -> list[str]:
    """Names of the seams filled in this process (empty on a GPU)."""
    return _EAGER + _INSTALLED


def eager_jit_fuser() -> list[str]:
    """megatron-core's ``jit_fuser`` is ``torch.compile``: on a CPU-only torch, Inductor generates C++
    for each fused function (activations, router) at its first call and builds it with the local
    compiler for the vector ISA it detects -- seconds of CPU per process, for code outside ATen's
    kernels. Without CUDA those functions run eagerly (``TORCHDYNAMO_DISABLE=1``: ``torch.compile``
    returns the function unchanged). ``jit_fuser`` wraps at megatron-core's import, so this must run
    first: it does nothing once ``megatron.core`` is imported, on a GPU, or when the launcher set the
    variable to another value (a launcher's value is never overwritten). ``torch.compile`` itself then
    returns its argument as the disabled Dynamo would, without importing Dynamo on the way (~1 s of
    every CPU rank's start). Returns the seams filled (``installed()`` lists it)."""
    if not _EAGER and "megatron.core" not in sys.modules and os.environ.get(DYNAMO_OFF, "1") == "1" \
            and not torch.cuda.is_available():
        os.environ[DYNAMO_OFF] = "1"
        torch.compile = _compile_disabled
        _EAGER.append("eager_jit_fuser")
    return installed()


def _compile_disabled(model=None, **_options):
    """``torch.compile`` under ``TORCHDYNAMO_DISABLE=1``: the model or function unchanged (used as
    ``@torch.compile(...)``, the decorator that leaves it unchanged)."""
    return model if model is not None else (lambda fn: fn)


def install(*, force: bool = False) -> list[str]:
    """Fill every seam if CUDA is unavailable; idempotent. Returns the seams filled."""
    if _INSTALLED or (torch.cuda.is_available() and not force):
        return installed()
    require_supported()  # the seams name megatron-core internals of the supported range only
    for seam in SEAMS:
        seam()
        _INSTALLED.append(seam.__name__)
    return installed()


# --------------------------------------------------------------------------- helpers


_CUDA_LITERALS = [
    ("device='cuda'", "device='cpu'"),
    ('device="cuda"', 'device="cpu"'),
    ("'torch.cuda.FloatTensor'", "'torch.FloatTensor'"),
    ("'torch.cuda.HalfTensor'", "'torch.HalfTensor'"),
    ("'torch.cuda.BFloat16Tensor'", "'torch.BFloat16Tensor'"),
]


def _cuda_literals_to_cpu(target: str, literals=_CUDA_LITERALS, modules=None) -> None:
    """Recompile ``module:Qual.name`` with its hard-coded CUDA device literals pointed at the CPU.

    The source must still contain at least one literal, so a megatron-core change under the seam
    fails loudly here instead of running a half-patched function.
    """
    module_name, _, qualname = target.partition(":")
    module = importlib.import_module(module_name)
    *owner_path, attr = qualname.split(".")
    try:
        owner = module
        for part in owner_path:
            owner = getattr(owner, part)
        raw = inspect.getattr_static(owner, attr)
    except AttributeError:
        raise BitdetError(f"CPU backend: {target} is gone; megatron-core changed under the seam") from None
    fn = inspect.unwrap(raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw)
    src = textwrap.dedent(inspect.getsource(fn))
    hits = 0
    for old, new in literals:
        hits += src.count(old)
        src = src.replace(old, new)
    if not hits:
        raise BitdetError(f"CPU backend: {target} has no CUDA literal any more; megatron-core changed under the seam")
    # Compile inside a factory that defines __class__, so zero-argument super() keeps working.
    factory = "def __bitdet_factory__(__class__):\n" + textwrap.indent(src, "    ") + f"\n    return {fn.__name__}\n"
    namespace: dict = {}
    exec(compile(factory, f"<bitdet cpu seam {target}>", "exec"), module.__dict__, namespace)
    new = namespace["__bitdet_factory__"](owner if inspect.isclass(owner) else None)
    if isinstance(new, (staticmethod, classmethod)):
        setattr(owner, attr, new)
        return
    new.__wrapped__ = fn
    setattr(owner, attr, new)
    if not inspect.isclass(owner):
        rebind({raw: new}, modules)


class _NullEvent:
    """Stand-in for torch.cuda.Event: records wall-clock time so elapsed_time still means something."""

    def __init__(self, enable_timing: bool = False, **_):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0


class _NullStream:
    """Stand-in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *_, **__):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or _NullEvent()
        event.record()
        return event

    def synchronize(self):
        pass


_NULL_STREAM = _NullStream()

# --------------------------------------------------------------------------- seams


def torch_cuda_runtime():
    """Device/stream/event/memory queries (rotary embeddings, global memory buffer, schedules,
    optimizer, timers) initialize CUDA and raise; on CPU they mean: the CPU device, no-op ordering,
    and zero device memory (host peak memory is measured by bitdet itself)."""
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda device=None: None
    cuda.current_stream = lambda device=None: _NULL_STREAM
    cuda.default_stream = lambda device=None: _NULL_STREAM
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    for stat in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, stat, lambda device=None: 0)
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.memory_stats = lambda device=None: {}


def rng_tracker():
    """megatron's tensor-parallel RNG tracker stores and forks *CUDA* generator states; on CPU the
    device generator is the CPU generator, so the tracker forks that one (same semantics: named
    streams for TP / EP / DP regions, restored on exit)."""
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state, orig_name = torch.get_rng_state(), self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)


def triton_stand_in(name: str, **attrs) -> None:
    """Put a stand-in for the Triton-importing module ``name`` in ``sys.modules`` (unless it is loaded
    already or Triton is installed): megatron imports such modules at load time for paths training on
    CPU never takes; the stand-in's ``attrs`` say so if one is called."""
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(name)
    stub.__doc__ = "bitdet CPU stand-in: Triton is unavailable"
    for attr, value in attrs.items():
        setattr(stub, attr, value)
    sys.modules[name] = stub


def triton_inference_ops():
    """``ssm.mamba_mixer`` imports megatron's Triton tensor ops for dynamic inference at module
    import time, and Triton does not import without a driver. Training never calls them; the
    stand-in module raises if inference tries."""
    def unavailable(*_, **__):
        raise NotImplementedError("megatron dynamic inference needs Triton, which is unavailable on this machine")

    triton_stand_in("megatron.core.inference.contexts.attention_context.triton.tensor_ops",
                    **{fn: unavailable for fn in ("tensor_get_slice_after", "tensor_masked_update", "tensor_merge")})


def cuda_device_literals():
    """``device='cuda'`` is hard-coded in the optimizers' scalar buffers, gradient clipping and
    norms, the schedules' token counters, MoE metric tracking, default attention masks and the rerun
    state machine; ``clip_grads`` and the optimizers sort parameters by ``tensor.type()`` against
    'torch.cuda.FloatTensor' / 'HalfTensor' / 'BFloat16Tensor' (a CPU bf16 param is
    'torch.BFloat16Tensor': "Wrapped parameters must be one of torch.cuda.FloatTensor, ...")."""
    for target in (
        "megatron.core.optimizer.optimizer:MixedPrecisionOptimizer.__init__",
        "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
        "megatron.core.optimizer.optimizer:FP32Optimizer.__init__",
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
        "megatron.core.optimizer.clip_grads:get_grad_norm_fp32",
        "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
        "megatron.core.optimizer.clip_grads:count_zeros_fp32",
        "megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining",
        "megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_with_interleaving",
        "megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_without_interleaving",
        *(["megatron.core.transformer.moe.moe_utils:track_moe_metrics"] if supports(
            megatron_core_version(), SpecifierSet("<0.18")) else []),  # 0.18: moe_logging, CPU-aware
        "megatron.core.transformer.utils:get_default_causal_mask",
        "megatron.core.transformer.utils:get_sliding_window_causal_mask",
        "megatron.core.utils:local_multi_tensor_l2_norm",
        "megatron.core.rerun_state_machine:RerunStateMachine._reduce_any",
        *(["megatron.core.optimizer.optimizer:MegatronOptimizer.has_grad_norm_group"] if supports(
            megatron_core_version(), SpecifierSet(">=0.19")) else []),  # new in 0.19
    ):
        _cuda_literals_to_cpu(target)


def moe_cpu_splits():
    """The alltoall dispatcher turns split sizes into host values only for CUDA tensors; on CPU
    they stay tensors and ``all_to_all_single`` rejects them. Host values are taken as numpy copies,
    as the GPU path does. Also ``moe_utils`` names ``te_general_gemm`` even when TE failed to import."""
    from megatron.core.transformer.moe import moe_utils

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.detach().cpu().numpy().copy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    rebind({original: maybe_move_tensor_to_cpu})
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


SEAMS = [torch_cuda_runtime, rng_tracker, triton_inference_ops, cuda_device_literals, moe_cpu_splits]
