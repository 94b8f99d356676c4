"""The seams between Megatron-LM's ``megatron.training`` (core_v0.16.1) and a CPU-only torch.

Installed by the Megatron-LM entry point (``megatron_bitdet.megatron_lm``) after the megatron-core
seams and before the user's script is imported, only when CUDA is unavailable. Each seam says what
breaks without it; the source rewrites fail loudly when Megatron-LM's source changed under them.
"""
from __future__ import annotations

import importlib.util
import sys

import torch
from packaging.specifiers import SpecifierSet

from megatron_bitdet.compat.cpu_backend.seams import _CUDA_LITERALS, _cuda_literals_to_cpu, triton_stand_in
from megatron_bitdet.compat.rebind import rebind
from megatron_bitdet.compat.versions import megatron_core_version, supports
from megatron_bitdet.errors import BitdetError

_INSTALLED: list[str] = []
_PREFIXES = ("megatron.core", "megatron.training", "megatron.legacy")


def _modules() -> list:
    """Every imported megatron.core / megatron.training / megatron.legacy module (rebinding targets)."""
    return [m for n, m in list(sys.modules.items()) if n.startswith(_PREFIXES) and m is not None]

# tensor / module moves and CUDA generator calls, pointed at the CPU
_TRAINING_LITERALS = [
    *_CUDA_LITERALS,
    (".cuda(torch.cuda.current_device())", ".cpu()"),
    (".cuda(non_blocking=True)", ".cpu()"),
    (".cuda()", ".cpu()"),
    ("torch.cuda.get_rng_state()", "torch.get_rng_state()"),
    ("torch.cuda.set_rng_state(", "torch.set_rng_state("),
    ('device=torch.device("cuda")', 'device=torch.device("cpu")'),
]


def installed() -> list[str]:
    """Names of the megatron.training seams filled in this process (empty on a GPU)."""
    return list(_INSTALLED)


def install(*, force: bool = False) -> list[str]:
    """Fill every megatron.training seam if CUDA is unavailable (after ``cpu_backend.install()``)."""
    if _INSTALLED or (torch.cuda.is_available() and not force):
        return installed()
    from megatron_bitdet.compat import cpu_backend

    cpu_backend.install(force=force)
    batch_invariant_kernels()  # before megatron.training.initialize imports it
    for seam in SEAMS[1:]:
        seam()
    _INSTALLED.extend(s.__name__ for s in SEAMS)
    return installed()


def _rewrite_all(target: str, replacements) -> None:
    import inspect

    module_name, _, qualname = target.partition(":")
    fn = getattr(importlib.import_module(module_name), qualname)
    src = inspect.getsource(inspect.unwrap(fn))
    missing = [old for old, _ in replacements if old not in src]
    if missing:
        raise BitdetError(f"CPU backend: {target} no longer contains {missing}; Megatron-LM changed under the seam")
    _cuda_literals_to_cpu(target, replacements, _modules())


def batch_invariant_kernels():
    """``megatron.training.initialize`` imports megatron-core's batch-invariant kernels, which import
    Triton at module load (Triton needs a GPU driver; it is not installed for this). The stand-in has
    the module's public names; turning batch-invariant mode on raises, saying why."""
    def unavailable(*_, **__):
        raise BitdetError("--batch-invariant-mode needs megatron-core's Triton kernels; Triton is unavailable here")

    triton_stand_in(
        "megatron.core.transformer.custom_layers.batch_invariant_kernels",
        enable_batch_invariant_mode=unavailable,
        set_batch_invariant_mode=lambda enabled=True: unavailable() if enabled else None,
        disable_batch_invariant_mode=lambda: None,
        is_batch_invariant_mode_enabled=lambda: False,
        __all__=["set_batch_invariant_mode", "is_batch_invariant_mode_enabled",
                 "disable_batch_invariant_mode", "enable_batch_invariant_mode"],
    )


def allow_no_cuda():
    """``pretrain()`` calls ``initialize_megatron()`` without ``allow_no_cuda``: "Megatron requires CUDA"."""
    from megatron.training import initialize

    original = initialize.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize_megatron.__wrapped__ = original
    initialize.initialize_megatron = initialize_megatron
    rebind({original: initialize_megatron}, _modules())


def model_parallel_groups():
    """With 0 CUDA devices ``_initialize_distributed`` skips building the model-parallel groups (and
    would ask NCCL for the process group): the groups are built as with one device per rank, on gloo."""
    _rewrite_all("megatron.training.initialize:_initialize_distributed", [
        ("device_count = torch.cuda.device_count()", "device_count = 1  # bitdet CPU seam"),
        ("torch.cuda.set_device(args.local_rank)", "pass  # bitdet CPU seam"),
        ("torch.device(f'cuda:{args.local_rank}')", "None"),
        ("'backend': args.distributed_backend,", "'backend': 'gloo',"),
    ])


def tensor_parallel_seed():
    """With 0 CUDA devices ``_set_random_seed`` skips seeding megatron's tensor-parallel RNG tracker
    (dropout inside TP regions would then fail); the tracker forks the CPU generator here."""
    _rewrite_all("megatron.training.initialize:_set_random_seed", [
        ("if torch.cuda.device_count() > 0:", "if True:  # bitdet CPU seam"),
    ])


def prebuilt_helpers():
    """``_compile_dependencies`` runs ``make`` for the dataset helpers (the wheel ships them prebuilt,
    without a Makefile) and, where Megatron-LM still has ``megatron.legacy`` (before 0.18: 0.19's
    entry points have none and no longer call it), ``fused_kernels.load`` looks for nvcc."""
    from megatron.core.datasets import utils as dataset_utils

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        raise BitdetError("megatron-core's prebuilt dataset helpers (helpers_cpp) are missing")
    dataset_utils.compile_helpers = lambda: None
    if importlib.util.find_spec("megatron.legacy") is not None:
        from megatron.legacy import fused_kernels

        fused_kernels.load = lambda args: None


def no_jit_warmup():
    """``set_jit_fusion_options`` warms megatron's fused bias-GeLU / SwiGLU / dropout-add up on CUDA
    tensors; there is nothing to warm up on CPU (0.19 passes it ``tp_size=``)."""
    from megatron.training import initialize

    initialize._warmup_jit_function = lambda **_: None


def device_arch():
    """``validate_args`` reads the GPU's architecture (``torch.cuda.get_device_properties``) whenever TP or
    CP is above 1: "Torch not compiled with CUDA enabled". A CPU has no GPU architecture: 0, Megatron's
    pre-Blackwell branch (it then asks for ``CUDA_DEVICE_MAX_CONNECTIONS=1``, as on a Hopper)."""
    from megatron.training import utils

    original = utils.get_device_arch_version

    def get_device_arch_version():
        return 0

    get_device_arch_version.__wrapped__ = original
    rebind({original: get_device_arch_version}, _modules())


def training_device_literals():
    """``.cuda()`` calls, ``device='cuda'`` literals and CUDA generator calls in Megatron-LM's loop,
    data, checkpointing and logging functions."""
    for target in (
        "megatron.core.rerun_state_machine:RerunStateMachine._save_state",
        "megatron.core.rerun_state_machine:RerunStateMachine._restore_state",
        "megatron.training.checkpointing:read_metadata",
        "megatron.training.checkpointing:get_rng_state",
        "megatron.training.checkpointing:load_checkpoint",
        "megatron.training.training:pretrain",
        "megatron.training.training:get_model",
        "megatron.training.training:training_log",
        "megatron.training.training:checkpoint_and_decide_exit",
        "megatron.training.training:evaluate",
        "megatron.training.training:evaluate_and_print_results",
        "megatron.training.training:build_train_valid_test_data_loaders",
        *_moved_targets(),
    ):
        _cuda_literals_to_cpu(target, _TRAINING_LITERALS, _modules())


def _moved_targets() -> list[str]:
    """The CUDA-literal functions whose home depends on the version (read in the 0.16.1, 0.17.1, 0.18.2 and
    0.19.2 sources; run on 0.16.1 and 0.19.2). ``megatron.training.utils`` is a module before 0.18, a package
    from 0.18 whose functions live in ``utils.common_utils`` (re-exported by the package), and
    ``get_batch_on_this_tp_rank`` moved to ``megatron.core.utils``, whose only device is
    ``torch.cuda.current_device()`` (the CPU under the megatron-core seams). From 0.18 the config-container
    path (``pretrain_hybrid.py``) places the built chunks on the device in ``training.models.dist_utils``
    (``get_model`` is not called there). From 0.19 the norm's literals are in its helper ``_compute_norm_2``,
    and the placement moved to ``prepare_existing_model_chunks_for_distributed_training``."""
    found = megatron_core_version()
    if supports(found, SpecifierSet("<0.18")):
        utils = "megatron.training.utils"
        return [f"{utils}:calc_params_l2_norm", f"{utils}:calc_dtensor_params_l2_norm",
                f"{utils}:get_batch_on_this_tp_rank"]
    utils, dist = "megatron.training.utils.common_utils", "megatron.training.models.dist_utils"
    if supports(found, SpecifierSet("<0.19")):
        return [f"{utils}:calc_params_l2_norm", f"{utils}:calc_dtensor_params_l2_norm",
                f"{dist}:unimodal_build_distributed_models"]
    return [f"{utils}:_compute_norm_2", f"{utils}:calc_dtensor_params_l2_norm",
            f"{dist}:prepare_existing_model_chunks_for_distributed_training"]


def script_source(source: str) -> str:
    """The launched script's source with its own CUDA moves pointed at the CPU, once the seams are installed
    (unchanged otherwise): from 0.18 the entry points' ``get_batch`` moves each batch tensor itself
    (``batch[key].cuda(non_blocking=True)``), which ``get_batch_on_this_tp_rank`` did before (rewritten above).
    Line for line, so a traceback still points at the script's own lines."""
    if not _INSTALLED:
        return source
    for old, new in _TRAINING_LITERALS:
        source = source.replace(old, new)
    return source


SEAMS = [batch_invariant_kernels, allow_no_cuda, model_parallel_groups, tensor_parallel_seed, prebuilt_helpers,
         no_jit_warmup, device_arch, training_device_literals]
