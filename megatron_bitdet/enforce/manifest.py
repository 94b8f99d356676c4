"""Run manifest: the resolved recipe, what enforcement applied, and the flat validation ``scope``
(everything that must be equal for a bitwise comparison to be meaningful)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys

from megatron_bitdet.enforce.env import EMULATED_RING_ENV, ENV_TABLE
from megatron_bitdet.enforce.facts import package_versions
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.rundir import manifest_path

MANIFEST_KEYS = ("bitdet_version", "created", "recipe", "recipe_digest", "scope", "env", "rules", "patches", "argv")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device_scope() -> dict:
    import torch

    scope = {"cuda": torch.version.cuda, "device_type": "cpu", "device_count": 0, "device_names": []}
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        scope.update(device_type="cuda", device_count=count,
                     device_names=[torch.cuda.get_device_name(i) for i in range(count)],
                     cudnn=torch.backends.cudnn.version(), nccl=".".join(map(str, torch.cuda.nccl.version())))
    return scope


def gather_placement() -> dict:
    """Where every rank runs (host per rank, node count, the emulated ring if any): one
    all_gather_object at setup, before any traced or timed step."""
    import torch.distributed as dist

    me = {"host": socket.gethostname(), "local_rank": int(os.environ.get("LOCAL_RANK", 0))}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, me)
    return {"ranks": ranks, "nodes": sorted({r["host"] for r in ranks}),
            "emulated_ring": os.environ.get(EMULATED_RING_ENV)}


def placement_in_scope(recipe) -> bool:
    """Placement (hosts, ring) is outside the validation scope only with topology-invariant
    reductions (``dp_invariant`` includes them): otherwise another allocation may reduce in another order."""
    return recipe.determinism.reductions not in ("topology_invariant", "dp_invariant")


def torch_flags() -> dict:
    """torch's determinism switches as they are now (a model provider or a script may have changed them)."""
    import torch

    return {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "fill_uninitialized_memory": bool(torch.utils.deterministic.fill_uninitialized_memory)}


def precision_scope(model) -> str:
    """The numeric formats the run computes in: params dtype, then FP8's or NVFP4's recipe and parts."""
    out = model.params_dtype
    if model.fp8.recipe != "none":
        out += f" fp8:{model.fp8.recipe}/{model.fp8.format}"
    f = model.fp4
    if f.recipe != "none":
        parts = [p for p, on in (("2d_weights", f.weight_2d_scaling), ("hadamard", f.hadamard),
                                 ("stochastic_rounding", f.stochastic_rounding)) if on]
        out += f" fp4:{f.recipe}/{f.format}[{','.join(parts)}]"
    return out


# The cross-virtual-rank structure dp_invariant runs (kernels.moe_aux.tree_sum over train.reductions'
# VirtualLayout / GradTree): its bits are those of this structure, so a change to it gets a new name here and
# runs of another structure (or of none recorded) leave the scope instead of comparing as DIVERGED.
DP_INVARIANT_TREE = "pairwise-halves-first/strided-hosting/bit-reversed-runs"


def build_scope(recipe, *, world_size: int, threads: int, placement: dict | None = None,
                model_provider: str | None = None) -> dict:
    """The flat validation scope for this process, recipe and world size; the model provider (a
    different model is a different run) and torch's live determinism flags are part of it."""
    p = recipe.parallel
    model_parallel = p.tensor * p.pipeline * p.context
    scope = {"python": platform.python_version(), "cpu_model": _cpu_model(), "torch_threads": threads}
    scope.update({f"version/{k}": v for k, v in package_versions().items()})
    scope.update(_device_scope())
    scope.update({f"env/{v.name}": os.environ.get(v.name) for v in ENV_TABLE})
    scope.update({
        "world_size": world_size, "tp": p.tensor, "pp": p.pipeline, "cp": p.context,
        "dp": world_size // model_parallel if world_size % model_parallel == 0 else None,
        "ep": p.expert, "etp": p.expert_tensor, "sp": p.sequence_parallel,
        "deterministic_mode": recipe.determinism.mode, "recipe_digest": recipe.digest(),
        "seed": recipe.training.seed, "model_provider": model_provider or "default",
        "precision": precision_scope(recipe.model),
    })
    scope.update({f"torch/{k}": v for k, v in torch_flags().items()})
    if recipe.determinism.reductions == "dp_invariant":
        scope["dp_invariant_tree"] = DP_INVARIANT_TREE
    if placement is not None and placement_in_scope(recipe):
        scope["placement"] = json.dumps({"hosts": [r["host"] for r in placement["ranks"]],
                                         "emulated_ring": placement["emulated_ring"]})
    return scope


def build_manifest(recipe, enforcement, *, world_size: int, argv=None, extra=None, placement=None,
                   model_provider: str | None = None) -> dict:
    """The manifest dict (DESIGN.md keys); ``extra`` (e.g. {'patches': [...]}) is merged on top."""
    from megatron_bitdet import __version__

    manifest = {
        "bitdet_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "recipe": recipe.to_dict(),
        "recipe_digest": recipe.digest(),
        "scope": build_scope(recipe, world_size=world_size, threads=enforcement.threads, placement=placement,
                             model_provider=model_provider),
        "placement": placement,
        "env": {name: {"value": s.value, "source": s.source, **({} if s.in_effect else {"in_effect": False})}
                for name, s in enforcement.env.items()},
        "rules": enforcement.rules.as_manifest(),
        "patches": list(enforcement.patches),
        "warnings": list(enforcement.warnings),
        "argv": list(sys.argv if argv is None else argv),
    }
    manifest.update(extra or {})
    return manifest


def write_manifest(run_dir, manifest: dict) -> str:
    """Atomically write RUN_DIR/manifest.json (tmp file + os.replace); returns its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = str(manifest_path(run_dir))
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def load_manifest(path) -> dict:
    """Read a manifest (a file, or a run dir holding manifest.json); BitdetInputError when unusable."""
    if os.path.isdir(path):
        path = str(manifest_path(path))
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise BitdetInputError(f"{path}: no manifest (was the run started with bitdet?)") from None
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, not UTF-8, over-long integers
        raise BitdetInputError(f"{path}: malformed manifest: {str(exc)[:200]}") from None
    missing = [k for k in MANIFEST_KEYS if not isinstance(manifest, dict) or k not in manifest]
    if missing:
        raise BitdetInputError(f"{path}: malformed manifest: missing {', '.join(missing)}")
    if not isinstance(manifest["scope"], dict):
        raise BitdetInputError(f"{path}: malformed manifest: scope is not a mapping")
    return manifest


def scope_diff(scope_a: dict, scope_b: dict) -> list:
    """[(key, a, b)] for every scope key whose values differ (a key missing on one side shows as None)."""
    return [(k, scope_a.get(k), scope_b.get(k)) for k in sorted(set(scope_a) | set(scope_b))
            if scope_a.get(k) != scope_b.get(k)]
