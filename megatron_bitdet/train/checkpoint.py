"""Full-state checkpoints with megatron-core ``dist_checkpointing``.

What a restore needs to continue bit for bit: model and optimizer shards (distributed optimizer
included; FP8 scaling state rides in the model as buffers), the fp32 source of a mixed-precision
run with its compute copy rebuilt from it (``precision.rebuild_compute_copy``), the LR scheduler, the iteration, *every* RNG (python, numpy, torch CPU, CUDA, megatron's
tracker) and the data position, per rank. A save is atomic: shards go to ``iter_N.tmp/``; only
after every rank finished does rank 0 write ``bitdet_meta.json`` (digests of every file) and rename
the directory, then ``latest``. A directory without that file is incomplete by definition, and a
digest mismatch on load is reported as corruption.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import xxhash

from megatron_bitdet.compat.checkpoint import SHARDED_METADATA, load_optimizer_state, prepare_optimizer_for_load
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.rundir import LATEST, iter_dir
from megatron_bitdet.train.precision import rebuild_compute_copy

META = "bitdet_meta.json"


# ----------------------------------------------------------------------------- RNG


def capture_rng() -> dict:
    """Every generator a run draws from, as tensors and ints (safe for weights_only loading)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    version, py_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch_cpu": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict, *, skip: frozenset = frozenset()) -> None:
    """Inverse of capture_rng. ``skip`` names components left alone (fault-injection tests only)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    if "python" not in skip:
        p = state["python"]
        random.setstate((p["version"], tuple(p["state"].tolist()), p["gauss"]))
    if "numpy" not in skip:
        n = state["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "torch_cpu" not in skip:
        torch.set_rng_state(state["torch_cpu"])
    if "cuda" in state and "cuda" not in skip:
        torch.cuda.set_rng_state(state["cuda"])
    if "tracker" not in skip:
        get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})


# ----------------------------------------------------------------------------- state dict


def _sharded_state_dict(ddp_modules, optimizer, *, rank: int, world: int, extra: dict, is_loading: bool):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model_sd = {}
    for i, m in enumerate(ddp_modules):
        model_sd[f"model{i}" if len(ddp_modules) > 1 else "model"] = m.module.sharded_state_dict(
            metadata=SHARDED_METADATA
        )
    flat_model = {}
    for sd in model_sd.values():
        flat_model.update(sd)
    state = dict(model_sd)
    state["optimizer"] = optimizer.sharded_state_dict(flat_model, is_loading=is_loading, metadata=SHARDED_METADATA)
    # Per-rank state: one ShardedObject slot per rank.
    state["bitdet_rank_state"] = ShardedObject(
        "bitdet_rank_state", extra.get("rank_state"), (world,), (rank,), replica_id=0
    )
    state["scheduler"] = extra.get("scheduler")
    state["iteration"] = extra.get("iteration")
    return state


def _file_digests(directory: Path) -> dict:
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != META:
            h = xxhash.xxh3_128()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
            out[str(path.relative_to(directory))] = h.hexdigest()
    return out


def save_checkpoint(root, iteration: int, *, ddp_modules, optimizer, scheduler, rank_state: dict, manifest: dict):
    """Collective: every rank calls it. Returns the final directory."""
    from megatron.core import dist_checkpointing

    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    final = iter_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _sharded_state_dict(
        ddp_modules, optimizer, rank=rank, world=world, is_loading=False,
        extra={"rank_state": rank_state, "scheduler": scheduler.state_dict(), "iteration": iteration},
    )
    dist_checkpointing.save(state, str(tmp))
    dist.barrier()
    if rank == 0:
        meta = {"iteration": iteration, "world_size": world, "files": _file_digests(tmp), "manifest": manifest}
        with open(tmp / META, "wb") as f:
            f.write(_meta_bytes(meta))
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = Path(root) / (LATEST + ".tmp")
        latest_tmp.write_text(f"{iteration}\n")
        os.replace(latest_tmp, Path(root) / LATEST)
    dist.barrier()
    return final


def resolve_checkpoint(path) -> Path:
    """``path`` is a checkpoints root (use ``latest``) or one ``iter_N`` directory; verify it is complete."""
    path = Path(path)
    if (path / LATEST).is_file():
        text = (path / LATEST).read_bytes().decode("utf-8", errors="replace").strip()
        if not text.isdigit() or not text.isascii() or len(text) > 18:
            raise BitdetInputError(f"{path / LATEST}: expected an iteration number, found {text[:40]!r}")
        path = iter_dir(path, int(text))
    if not (path / META).is_file():
        raise BitdetInputError(
            f"{path}: not a complete bitdet checkpoint (no {META}: the save did not finish, or this is not a "
            "checkpoint directory)"
        )
    return path


def _meta_digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "digest"}
    return "xxh3_128:" + xxhash.xxh3_128_hexdigest(json.dumps(body, indent=1, sort_keys=True).encode())


def _meta_bytes(meta: dict) -> bytes:
    """The canonical bytes of bitdet_meta.json, carrying a digest of its own content: a changed byte
    anywhere (in a digest, the manifest or the layout) is refused, not trusted."""
    return json.dumps({**meta, "digest": _meta_digest(meta)}, indent=1, sort_keys=True).encode()


def read_meta(path: Path) -> dict:
    """``path/bitdet_meta.json``, exactly as saved; BitdetInputError naming the file otherwise."""
    where = path / META
    try:
        raw = where.read_bytes()
        meta = json.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise BitdetInputError(f"{where}: unreadable checkpoint metadata: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise BitdetInputError(f"{where}: corrupt checkpoint metadata (not UTF-8 at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise BitdetInputError(f"{where}:{exc.lineno}: corrupt checkpoint metadata (not JSON: {exc.msg})") from None
    except (ValueError, RecursionError) as exc:  # over-long integers, deep nesting
        raise BitdetInputError(f"{where}: corrupt checkpoint metadata ({str(exc)[:200]})") from None
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise BitdetInputError(f"{where}: corrupt checkpoint metadata (no 'files' digest table)")
    for key in ("iteration", "world_size"):
        if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool):
            raise BitdetInputError(f"{where}: corrupt checkpoint metadata ({key!r} is not an integer)")
    if meta.get("digest") != _meta_digest(meta) or raw != _meta_bytes(meta):
        raise BitdetInputError(f"{where}: corrupt checkpoint metadata (its content does not match its digest, "
                               "or it was rewritten: the file is not as saved)")
    return meta


def verify_checkpoint(path: Path) -> dict:
    """Check the metadata and every file against the digests recorded at save; return the metadata."""
    meta = read_meta(path)
    actual = _file_digests(path)
    expected = meta["files"]
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    changed = sorted(k for k in expected if k in actual and actual[k] != expected[k])
    if missing or changed or extra:
        parts = [f"missing: {', '.join(missing)}"] if missing else []
        parts += [f"digest mismatch: {', '.join(changed)}"] if changed else []
        parts += [f"not saved with it: {', '.join(extra)}"] if extra else []
        raise BitdetInputError(f"{path}: checkpoint is corrupt ({'; '.join(parts)})")
    return meta


def load_checkpoint(path, *, ddp_modules, optimizer, scheduler, world_size: int) -> tuple[int, dict]:
    """Collective. Restores model, optimizer, scheduler; returns (iteration, this rank's state)."""
    from megatron.core import dist_checkpointing

    path = resolve_checkpoint(path)
    meta = verify_checkpoint(path)
    if meta.get("world_size") != world_size:
        raise BitdetInputError(
            f"{path}: saved with world size {meta.get('world_size')}, resuming with {world_size}; a bitwise "
            "resume needs the same layout"
        )
    rank = torch.distributed.get_rank()
    prepare_optimizer_for_load(optimizer)
    template = _sharded_state_dict(
        ddp_modules, optimizer, rank=rank, world=world_size, is_loading=True,
        extra={"rank_state": None, "scheduler": None, "iteration": None},
    )
    state = dist_checkpointing.load(template, str(path))
    keys = [k for k in state if k.startswith("model")]
    for key, m in zip(sorted(keys), ddp_modules):
        m.module.load_state_dict(state[key], strict=True)
    load_optimizer_state(optimizer, state["optimizer"])
    # The fp32 source is restored; the 16-bit compute copy is rebuilt from it the way training does.
    rebuild_compute_copy(optimizer)
    scheduler.load_state_dict(state["scheduler"])
    return int(state["iteration"]), state["bitdet_rank_state"]
