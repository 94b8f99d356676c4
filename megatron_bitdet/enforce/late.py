"""Late-application detection: a variable set after its reader already initialized has no effect.

Only variables whose value enforcement actually changes count (a launcher's value was in place before
anything read it). Each reader says how to tell it already ran and whether that is fatal. PYTHONHASHSEED
is judged by what the interpreter really hashes with (``EnvSetting.in_effect``), whoever set it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_bitdet.enforce.env import ENV_BY_NAME
from megatron_bitdet.enforce.facts import Facts


@dataclass(frozen=True)
class Reader:
    key: str
    ran: Callable[[Facts], bool]
    fatal: Callable[[Facts], bool]
    what: str
    move: str


READERS = {r.key: r for r in (
    Reader("nccl", lambda f: f.dist_backend is not None, lambda f: "nccl" in (f.dist_backend or ""),
           "a torch.distributed process group already exists", "call enable() before init_process_group "
           "(NCCL communicators pick their algorithm when created)"),
    Reader("cublas", lambda f: f.cuda_initialized, lambda f: True,
           "CUDA is already initialized, so cuBLAS handles may exist with the default workspace",
           "call enable() before the first CUDA call, or export the variable in the launcher"),
    Reader("transformer_engine", lambda f: "transformer_engine" in f.imported, lambda f: f.cuda_initialized,
           "transformer_engine is already imported", "call enable() before importing transformer_engine / "
           "megatron.core.extensions (TE reads NVTE_* when it selects attention backends)"),
    Reader("mamba_ssm", lambda f: "mamba_ssm" in f.imported, lambda f: True,
           "mamba_ssm is already imported", "call enable() before importing mamba_ssm or megatron.core.ssm"),
    Reader("causal_conv1d", lambda f: "causal_conv1d" in f.imported, lambda f: True,
           "causal_conv1d is already imported", "call enable() before importing causal_conv1d or megatron.core.ssm"),
    Reader("inductor", lambda f: "torch._inductor.config" in f.imported, lambda f: True,
           "torch._inductor.config is already imported (it reads TORCHINDUCTOR_* at import)",
           "call enable() before torch.compile / importing torch._inductor"),
    Reader("cuda", lambda f: f.cuda_initialized, lambda f: True,
           "CUDA is already initialized (the context read CUDA_DEVICE_MAX_CONNECTIONS when it was created)",
           "call enable() before the first CUDA call, or export the variable in the launcher"),
)}


def late_application(settings, environ, facts: Facts):
    """(refusals as (variables, message, fix), warnings): readers that already ran while we change their
    variables; a gloo group is reported as a harmless warning."""
    changed = {}
    for name, setting in settings.items():
        if setting.value is not None and environ.get(name) != setting.value:
            changed.setdefault(ENV_BY_NAME[name].read_by, []).append(name)
    refusals, warnings = [], []
    for name, setting in settings.items():
        if not setting.in_effect:  # python: read once, when the interpreter started
            warnings.append(f"this interpreter started with randomized str hashing, so {name}={setting.value} "
                            f"reaches only the processes it starts (recorded as not in effect); start it with "
                            f"the variable exported and without python -E/-I: {name}={setting.value} torchrun ... "
                            "(bitdet's own launchers re-execute a rank for you)")
    if facts.dist_backend is not None and not READERS["nccl"].fatal(facts):
        warnings.append(f"a {facts.dist_backend} process group already exists: harmless ({facts.dist_backend} "
                        "reads none of the determinism variables), but create NCCL groups only after enable()")
    for key, names in changed.items():
        reader = READERS.get(key)
        if reader is None or not reader.ran(facts):
            continue
        if reader.fatal(facts):
            refusals.append((names, f"{reader.what} but enforcement sets {', '.join(names)}", reader.move))
        elif key != "nccl":
            warnings.append(f"{reader.what}; enforcement sets {', '.join(names)}: {reader.move}")
    return refusals, warnings
