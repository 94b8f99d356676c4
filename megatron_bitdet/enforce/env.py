"""The canonical determinism environment: upstream Megatron-LM's table plus what a bitwise run also needs.

A launcher's value is validated, never overwritten; unset variables with a default are filled; a
recipe's ``determinism.env`` sets values too (validated the same way, and must agree with the launcher).
Where a determinism *rule* judges a variable (``governed_by``), this table only checks the syntax and the
rule decides, so the refusal carries the rule's why/fix and the rule's opt-out applies.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from megatron_bitdet.errors import BitdetInputError

NCCL_ALGOS = ("Ring", "Tree", "CollnetDirect", "CollnetChain", "NVLS", "NVLSTree", "PAT")
# An allow-list, never an exclusion: NCCL reads a leading ^ as "any algorithm but these", so ^NVLS (which
# Megatron-LM accepts) still lets NCCL pick Tree, NVLSTree or PAT per message size and topology. The
# Collnet ones are upstream Megatron-LM's accepted set (in-network reduction in one fixed tree).
NCCL_DETERMINISTIC = ("Ring", "CollnetDirect", "CollnetChain")


def nccl_tokens(value: str) -> list:
    return [t.strip() for t in value.split(",") if t.strip()]


def _nccl_syntax(value: str) -> bool:
    known = {a.lower() for a in NCCL_ALGOS}
    tokens = nccl_tokens(value)
    return bool(tokens) and all(t.lstrip("^").lower() in known for t in tokens)


def nccl_refusal(value: str) -> Optional[str]:
    """Why NCCL_ALGO=value lets NCCL pick a nondeterministic algorithm, or None when it names only
    deterministic ones."""
    tokens = nccl_tokens(value)
    if any(t.startswith("^") for t in tokens):
        excluded = {t.lstrip("^").lower() for t in tokens}
        still = [a for a in NCCL_ALGOS if a.lower() not in excluded]
        return (f"NCCL_ALGO={value!r} is an exclusion list: it still allows {', '.join(still)}; "
                f"name the algorithms instead ({', '.join(NCCL_DETERMINISTIC)})")
    ok = {a.lower() for a in NCCL_DETERMINISTIC}
    bad = [t for t in tokens if t.lower() not in ok]
    return f"NCCL_ALGO={value!r} allows {', '.join(bad)}" if bad else None


def _one_of(*values):
    return lambda v: v in values


def _positive_int(v: str) -> bool:
    return v.isdigit() and int(v) > 0


def hash_seed_in_effect() -> Optional[str]:
    """The PYTHONHASHSEED this interpreter hashes str/bytes with, or None when randomized. Python
    fixes it at start-up, so it is read from the environment the process started with (Linux
    /proc/self/environ), not from os.environ, which bitdet or a script may have changed since."""
    if not sys.flags.hash_randomization:
        return "0"
    if sys.flags.ignore_environment:  # python -E / -I
        return None
    try:
        with open("/proc/self/environ", "rb") as fh:
            start = fh.read().split(b"\0")
    except OSError:
        return None
    seed = next((kv[len(b"PYTHONHASHSEED="):] for kv in start if kv.startswith(b"PYTHONHASHSEED=")), b"")
    return str(int(seed)) if seed.isdigit() else None


def _one_cuda_connection(recipe) -> Optional[str]:
    """megatron's tensor/context-parallel overlap relies on one CUDA connection (kernels and collectives
    start in launch order); Megatron-LM asserts it before Blackwell. Set for every GPU generation (the
    architecture is unknown until CUDA initializes, which must come after this); a launcher value stays."""
    p = getattr(recipe, "parallel", None)
    return "1" if p is not None and (p.tensor > 1 or p.context > 1) else None


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: Optional[str]          # filled when unset; None = only recorded
    valid: Callable[[str], bool]    # accepted values (or, when governed_by, the well-formed ones)
    accepted: str                   # the accepted values, for messages
    read_by: str                    # reader key for late-application checks (see enforce.late)
    why: str
    governed_by: Optional[str] = None
    layout_default: Optional[Callable] = None  # recipe -> a default when the layout needs one (else None)


ENV_TABLE = (
    EnvVar("NCCL_ALGO", "Ring", _nccl_syntax, f"a comma-separated list of {', '.join(NCCL_DETERMINISTIC)}",
           "nccl", "pins the collective algorithm (Tree/NVLS reduce in topology-dependent order)",
           governed_by="nccl_tree"),
    EnvVar("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0", _one_of("0", "1"), "0",
           "transformer_engine", "TE then selects only deterministic attention backends",
           governed_by="te_attention_nondeterministic"),
    EnvVar("CUBLAS_WORKSPACE_CONFIG", ":4096:8", _one_of(":4096:8", ":16:8"), ":4096:8 or :16:8",
           "cublas", "a fixed cuBLAS workspace makes split-K GEMM reductions reproducible"),
    EnvVar("MAMBA_DETERMINISTIC", "1", lambda v: v.startswith("1"), "a value starting with 1",
           "mamba_ssm", "mamba-ssm Triton kernels: pinned autotune config, ordered workspace sums"),
    EnvVar("CAUSAL_CONV1D_DETERMINISTIC", "1", lambda v: v.startswith("1"), "a value starting with 1",
           "causal_conv1d", "causal_conv1d >= 1.6 backward: per-block workspace instead of atomics"),
    EnvVar("TORCHINDUCTOR_MAX_AUTOTUNE", "0", _one_of("0", "1"), "0", "inductor",
           "inductor max-autotune benchmarks kernels at run time and may pick a different one each run",
           governed_by="torch_compile_max_autotune"),
    EnvVar("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM", "0", _one_of("0", "1"), "0", "inductor",
           "as TORCHINDUCTOR_MAX_AUTOTUNE, for GEMM templates only", governed_by="torch_compile_max_autotune"),
    EnvVar("PYTHONHASHSEED", "0", lambda v: v.isdigit(), "a decimal integer (not 'random')", "python",
           "str/bytes hashing (set iteration order); read once, when the interpreter starts"),
    EnvVar("NVTE_FLASH_ATTN", None, _one_of("0", "1"), "0 or 1", "transformer_engine",
           "recorded: which TE attention backends may be chosen is part of the scope"),
    EnvVar("NVTE_FUSED_ATTN", None, _one_of("0", "1"), "0 or 1", "transformer_engine",
           "recorded: which TE attention backends may be chosen is part of the scope"),
    EnvVar("NVTE_UNFUSED_ATTN", None, _one_of("0", "1"), "0 or 1", "transformer_engine",
           "recorded: which TE attention backends may be chosen is part of the scope"),
    EnvVar("OMP_NUM_THREADS", None, _positive_int, "a positive integer", "openmp",
           "recorded: CPU reductions may split work by thread count, so it may change the bits"),
    EnvVar("MKL_NUM_THREADS", None, _positive_int, "a positive integer", "openmp",
           "recorded: as OMP_NUM_THREADS for MKL kernels"),
    EnvVar("CUDA_DEVICE_MAX_CONNECTIONS", None, _positive_int, "a positive integer", "cuda",
           "changes kernel/communication overlap scheduling in megatron (1 with tensor/context parallelism)",
           layout_default=_one_cuda_connection),
)
ENV_BY_NAME = {v.name: v for v in ENV_TABLE}
# Tests and benchmarks only: route reductions over an emulated physical ring chosen by this seed
# (kernels/reductions.py), standing in for the ring another allocation would get. Part of the
# run's placement, not of its environment scope.
EMULATED_RING_ENV = "BITDET_EMULATED_RING"


@dataclass(frozen=True)
class EnvSetting:
    value: Optional[str]
    source: str  # launcher | recipe | default | unset
    in_effect: bool = True  # False: PYTHONHASHSEED set after this interpreter started (its children get it)


def resolve_env(recipe, environ: Mapping[str, str]):
    """(settings by name, list of (name, message, fix)) for the recipe under the launcher's environ."""
    wanted = dict(recipe.determinism.env)
    unknown = [k for k in wanted if k not in ENV_BY_NAME]
    if unknown:
        known = ", ".join(ENV_BY_NAME)
        raise BitdetInputError("\n".join(
            f"{recipe.where('determinism', 'env', k)}: determinism.env.{k}: not a determinism variable; "
            f"known: {known}" for k in unknown))
    settings, problems = {}, []
    for var in ENV_TABLE:
        launcher, mine = environ.get(var.name), wanted.get(var.name)
        if launcher is not None and mine is not None and launcher != mine:
            problems.append((var.name, f"the launcher sets {var.name}={launcher!r} but "
                             f"{recipe.where('determinism', 'env', var.name)} sets {mine!r}",
                             "make them agree: a launcher value is never overwritten"))
        default = var.default if var.default is not None else var.layout_default and var.layout_default(recipe)
        value, source = next(((v, src) for v, src in ((launcher, "launcher"), (mine, "recipe"), (default, "default"))
                              if v is not None), (None, "unset"))
        # str hashing is fixed when the interpreter starts: a seed set now reaches only its children
        in_effect = var.name != "PYTHONHASHSEED" or value is None or not value.isdigit() \
            or hash_seed_in_effect() == str(int(value))
        settings[var.name] = EnvSetting(value, source, in_effect)
        if value is not None and not var.valid(value):
            where = "the launcher" if launcher is not None else recipe.where("determinism", "env", var.name)
            problems.append((var.name, f"{var.name}={value!r} (from {where}) is refused; accepted: {var.accepted}",
                             f"set {var.name} to {var.accepted} (or unset it to get {var.default!r})"
                             if var.default is not None else f"set {var.name} to {var.accepted} or unset it"))
    return settings, problems


def effective_env(settings) -> dict:
    return {name: s.value for name, s in settings.items() if s.value is not None}
