"""Read a run's per-step fingerprints into one in-memory shape, strictly.

A comparison is only as good as its input: every malformed, truncated or foreign line is
refused with its file and line (BitdetInputError, exit 2) instead of being skipped, so a
"match" can never come from silently dropped steps.
"""
from __future__ import annotations

from pathlib import Path

from megatron_bitdet.analysis.run_data import RunData
from megatron_bitdet.enforce.manifest import load_manifest
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.fingerprint.steps import RANK_FILE, read_rank_file
from megatron_bitdet.rundir import fingerprints_dir, manifest_path


def detect_format(path: Path) -> str:
    """'bitdet' for a run directory, 'tensorboard' for a dir of event files."""
    if not path.exists():
        raise BitdetInputError(f"{path}: no such run directory")
    if not path.is_dir():
        raise BitdetInputError(f"{path}: not a directory (expected a run dir or a TensorBoard log dir)")
    if fingerprints_dir(path).is_dir():
        return "bitdet"
    if any(path.glob("events.out.tfevents.*")):
        return "tensorboard"
    raise BitdetInputError(
        f"{path}: neither a bitdet run (no fingerprints/ directory) nor a TensorBoard log dir "
        "(no events.out.tfevents.* files)"
    )


def load_run(path, fmt: str = "auto", *, allow_truncated: bool = False) -> RunData:
    """Load a run directory or a TensorBoard log dir; fmt is 'auto', 'bitdet' or 'tensorboard'."""
    path = Path(path)
    kind = detect_format(path) if fmt == "auto" else fmt
    if kind == "tensorboard":
        from megatron_bitdet.analysis.tensorboard_io import load_tensorboard

        if not path.is_dir():
            raise BitdetInputError(f"{path}: no such TensorBoard log directory")
        return load_tensorboard(path, allow_truncated=allow_truncated)
    if kind != "bitdet":
        raise BitdetInputError(f"unknown run format {fmt!r} (expected auto, bitdet or tensorboard)")
    return _load_bitdet(path, allow_truncated)


def _load_bitdet(path: Path, allow_truncated: bool) -> RunData:
    fp_dir = fingerprints_dir(path)
    if not fp_dir.is_dir():
        raise BitdetInputError(f"{path}: no fingerprints/ directory (not a bitdet run dir?)")
    files = {}
    for f in sorted(fp_dir.iterdir()):
        m = RANK_FILE.fullmatch(f.name)
        if m:
            files[int(m.group(1))] = f
    if not files:
        raise BitdetInputError(f"{fp_dir}: no rank_XXXXX.jsonl fingerprint files")
    run = RunData(path=path, format="bitdet", ranks={}, files=files)
    for rank, f in files.items():
        warned = len(run.warnings)
        run.ranks[rank] = read_rank_file(f, rank, allow_truncated=allow_truncated, warnings=run.warnings)
        if len(run.warnings) > warned:
            run.truncated.append(f)
    run.manifest = read_manifest(manifest_path(path))
    return run


def read_manifest(path: Path) -> dict | None:
    """The run manifest, or None when the run has none; a corrupt one is unusable input."""
    return load_manifest(path) if path.exists() else None


def require_every_rank(run: RunData, hint: str = "") -> None:
    """Refuse (exit 2) a bitdet run whose fingerprint files are not exactly its manifest's world: a
    missing rank was compared by nobody, so no verdict may cover it (``hint``: what the caller's user
    can do instead)."""
    world = ((run.manifest or {}).get("scope") or {}).get("world_size")
    if type(world) is not int:
        raise BitdetInputError(f"{run.path}: no manifest.json with scope.world_size: cannot tell whether every "
                               "rank's fingerprint file is present")
    missing = [r for r in range(world) if r not in run.ranks]
    if missing:
        raise BitdetInputError(f"{run.path}: the manifest's world_size is {world} but rank(s) {missing} have no "
                               f"fingerprint file (fingerprints/rank_{missing[0]:05d}.jsonl is missing){hint}")
    foreign = sorted(r for r in run.ranks if r >= world)
    if foreign:
        raise BitdetInputError(f"{run.files[foreign[0]]}: rank {foreign[0]} is outside the manifest's world_size "
                               f"{world}")
