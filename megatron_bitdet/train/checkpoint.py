"""Full-state checkpoints with megatron-core ``dist_checkpointing``.

What a restore needs to continue bit for bit: model and optimizer shards (distributed optimizer
included; FP8 scaling state rides in the model as buffers), the fp32 source of a mixed-precision
run with its compute copy rebuilt from it (``precision.rebuild_compute_copy``), the LR scheduler, the iteration, *every* RNG (python, numpy, torch CPU, CUDA, megatron's
tracker) and the data position, per rank. A save is atomic: shards go to ``iter_N.tmp/``; only
after every rank finished does rank 0 write ``bitdet_meta.json`` (digests of every file) and rename
the directory, then ``latest``. A directory without that file is incomplete by definition, and a
digest mismatch on load is reported as corruption.

Across data-parallel sizes: the metadata records every saving rank's coordinates (``ranks``). A load at
another world size with the same tensor / pipeline / context / expert layout reshards the model and the
distributed optimizer along DP (``dp_reshardable``, megatron-core's contract) and takes its per-rank state
(RNG, data position) from a saved rank with its own model-parallel coordinates; the saved DP ranks must
hold that state identically (megatron's seeds do not depend on the DP rank, and the data position is a
global sample count), else the resume is refused: no saved rank would be the right one.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import torch
import xxhash

from megatron_bitdet.compat.checkpoint import (
    SHARDED_METADATA,
    in_process_write_results,
    load_optimizer_state,
    prepare_optimizer_for_load,
)
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


# A rank's place in the layout: its model-parallel coordinates (which decide its shards and its
# TP / expert RNG streams) and its data-parallel rank.
_MODEL_PARALLEL = ("tp", "pp", "cp", "ep", "etp")


def rank_coordinates() -> dict:
    """This rank's ``_MODEL_PARALLEL`` coordinates and ``dp`` rank, from megatron's parallel state."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "cp": ps.get_context_parallel_rank(), "ep": ps.get_expert_model_parallel_rank(),
            "etp": ps.get_expert_tensor_parallel_rank(), "dp": ps.get_data_parallel_rank()}


def layout(parallel, world: int) -> list[dict]:
    """Every rank's ``rank_coordinates`` at ``world`` ranks under a recipe's ``parallel`` section, as
    megatron-core's ``initialize_model_parallel`` (default order) assigns them, without process groups."""
    from megatron.core.parallel_state import RankGenerator

    p, order = parallel, "tp-cp-ep-dp-pp"
    etp = p.expert_tensor or p.tensor
    dense = RankGenerator(tp=p.tensor, ep=1, dp=world // (p.tensor * p.pipeline * p.context), pp=p.pipeline,
                          cp=p.context, order=order)
    expert = RankGenerator(tp=etp, ep=p.expert, dp=world // (etp * p.expert * p.pipeline), pp=p.pipeline, cp=1,
                           order=order)
    coords = [{} for _ in range(world)]
    for generator, names in ((dense, {"tp": "tp", "pp": "pp", "cp": "cp", "dp": "dp"}),
                             (expert, {"ep": "ep", "etp": "tp"})):
        for key, token in names.items():
            for group in generator.get_ranks(token):
                for index, r in enumerate(group):
                    coords[r][key] = index
    return coords


def source_ranks(saved: list, coords: dict) -> list[int]:
    """The saved ranks with ``coords``' model-parallel coordinates, their DP rank ascending: the
    ranks whose per-rank state a rank at these coordinates may continue from (any, under another DP)."""
    same = [r for r, c in enumerate(saved) if all(c.get(k) == coords[k] for k in _MODEL_PARALLEL)]
    return sorted(same, key=lambda r: saved[r].get("dp", 0))


def _sharded_state_dict(ddp_modules, optimizer, *, rank: int, world: int, extra: dict, is_loading: bool,
                        saved_world: int | None = None):
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
    # Per-rank state: one ShardedObject slot per rank. A load at another world size (``saved_world``)
    # reads every saved slot on every rank (rank 0's copies the main replicas) and picks its own after.
    if saved_world is None:
        state["bitdet_rank_state"] = ShardedObject(
            "bitdet_rank_state", extra.get("rank_state"), (world,), (rank,), replica_id=0
        )
    else:
        state["bitdet_rank_state"] = {
            r: ShardedObject("bitdet_rank_state", None, (saved_world,), (r,), replica_id=rank)
            for r in range(saved_world)
        }
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
    in_process_write_results()  # bitdet's own loop saves synchronously
    dist_checkpointing.save(state, str(tmp))
    ranks = [None] * world
    dist.all_gather_object(ranks, rank_coordinates())
    if rank == 0:
        meta = {"iteration": iteration, "world_size": world, "ranks": ranks, "files": _file_digests(tmp),
                "manifest": manifest}
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


# Recipe keys that set the shape or dtype of a saved parameter or buffer (its presence too: biases,
# the expert bias, FP8 / NVFP4 state). A checkpoint saved under other values cannot load (megatron-core's
# CheckpointingException, inside the ranks), so ``check_recipe_shapes`` refuses it before any rank starts.
SHAPE_KEYS = (
    "model.hybrid_pattern", "model.hidden_size", "model.ffn_hidden_size", "model.num_attention_heads",
    "model.num_query_groups", "model.kv_channels", "model.vocab_size", "model.activation", "model.add_bias_linear",
    "model.normalization", "model.position_embedding", "model.params_dtype", "model.mtp_num_layers",
    "model.mamba.num_heads", "model.mamba.head_dim", "model.mamba.state_dim", "model.mamba.num_groups",
    "model.mamba.conv_kernel", "model.moe.num_experts", "model.moe.ffn_hidden_size",
    "model.moe.shared_expert_ffn_hidden_size", "model.moe.router_expert_bias", "model.fp8.recipe",
    "model.fp8.amax_history_len", "model.fp4.recipe",
)
_ABSENT = object()


def _dotted(d, key: str):
    for part in key.split("."):
        d = d.get(part, _ABSENT) if isinstance(d, dict) else _ABSENT
    return d


def check_recipe_shapes(path: Path, meta: dict, recipe) -> None:
    """Refuse (BitdetInputError naming the checkpoint's metadata file, each key and both values) a
    recipe whose ``SHAPE_KEYS`` differ from the recipe the checkpoint was saved by (its manifest's),
    and ``model.seq_length`` where either has learned absolute positions. A key the saving bitdet's
    recipe did not have is not compared."""
    saved = _dotted(meta.get("manifest"), "recipe")
    if not isinstance(saved, dict):
        return
    now = recipe.to_dict()
    keys = list(SHAPE_KEYS)
    if "learned_absolute" in (_dotted(saved, "model.position_embedding"), _dotted(now, "model.position_embedding")):
        keys.append("model.seq_length")
    differ = [(k, _dotted(saved, k), _dotted(now, k)) for k in keys
              if _dotted(saved, k) is not _ABSENT and _dotted(saved, k) != _dotted(now, k)]
    if differ:
        rows = "\n".join(f"  {k}: checkpoint {a!r}, this recipe {b!r}" for k, a, b in differ)
        raise BitdetInputError(f"{path / META}: the checkpoint was saved by a recipe whose parameter shapes differ "
                               f"from this one's in {len(differ)} key(s); --load needs the same:\n{rows}")


def load_checkpoint(path, *, ddp_modules, optimizer, scheduler, world_size: int) -> tuple[int, dict]:
    """Collective. Restores model, optimizer, scheduler; returns (iteration, this rank's state). A
    checkpoint saved at another world size loads when only the data-parallel size differs (module
    docstring)."""
    from megatron.core import dist_checkpointing

    path = resolve_checkpoint(path)
    meta = verify_checkpoint(path)
    rank = torch.distributed.get_rank()
    sources = None if meta["world_size"] == world_size else _cross_dp_sources(path, meta)
    prepare_optimizer_for_load(optimizer)
    template = _sharded_state_dict(
        ddp_modules, optimizer, rank=rank, world=world_size, is_loading=True,
        extra={"rank_state": None, "scheduler": None, "iteration": None},
        saved_world=None if sources is None else meta["world_size"],
    )
    state = dist_checkpointing.load(template, str(path))
    keys = [k for k in state if k.startswith("model")]
    for key, m in zip(sorted(keys), ddp_modules):
        m.module.load_state_dict(state[key], strict=True)
    load_optimizer_state(optimizer, state["optimizer"])
    # The fp32 source is restored; the 16-bit compute copy is rebuilt from it the way training does.
    rebuild_compute_copy(optimizer)
    scheduler.load_state_dict(state["scheduler"])
    rank_state = state["bitdet_rank_state"]
    if sources is not None:
        rank_state = _one_rank_state(path, {r: rank_state[r] for r in sources})
    return int(state["iteration"]), rank_state


def _cross_dp_sources(path: Path, meta: dict) -> list[int]:
    """The saved ranks this rank continues from at another world size (``source_ranks``); refused
    when the checkpoint does not record its layout or no saved rank has this rank's coordinates."""
    saved = meta.get("ranks")
    here = f"{path}: saved with world size {meta['world_size']}, resuming with {torch.distributed.get_world_size()}"
    if not isinstance(saved, list) or len(saved) != meta["world_size"] or not all(isinstance(c, dict) for c in saved):
        raise BitdetInputError(f"{here}, but the checkpoint does not record its ranks' layout (saved by an earlier "
                               f"bitdet): resume it with --nproc {meta['world_size']}")
    coords = rank_coordinates()
    sources = source_ranks(saved, coords)
    if not sources:
        mp = ", ".join(f"{k}={coords[k]}" for k in _MODEL_PARALLEL)
        raise BitdetInputError(f"{here}: no saved rank has this rank's model-parallel coordinates ({mp}); only the "
                               "data-parallel size may change across a resume (keep parallel.tensor / pipeline / "
                               "context / expert as saved)")
    return sources


def _one_rank_state(path: Path, loaded: dict) -> dict:
    """The per-rank state of the first of the saved DP ranks ``loaded`` holds (rank -> state), after
    checking they all hold it identically: otherwise which one continues would change the run."""
    ranks = sorted(loaded, key=int)
    first = loaded[ranks[0]]
    for r in ranks[1:]:
        where = _first_difference(first, loaded[r])
        if where is not None:
            raise BitdetInputError(
                f"{path}: saved ranks {ranks[0]} and {r} (the same model-parallel coordinates, different "
                f"data-parallel ranks) hold different per-rank state at {where}: a resume at another "
                "data-parallel size has no single state to continue from; resume with the saved --nproc")
    return first


def _first_difference(a, b, where: str = "") -> str | None:
    """The first key path at which two per-rank states differ (tensors by their bytes), or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in dict.fromkeys([*a, *b]):
            if key not in a or key not in b:
                return f"{where}.{key}".lstrip(".")
            found = _first_difference(a[key], b[key], f"{where}.{key}")
            if found is not None:
                return found.lstrip(".")
        return None
    if torch.is_tensor(a) and torch.is_tensor(b):
        same = (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(
            *(t.detach().reshape(-1).contiguous().view(torch.uint8) for t in (a, b)))
        return None if same else where or "."
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return where or "."
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _first_difference(x, y, f"{where}[{i}]"))), None)
    if isinstance(a, float) and isinstance(b, float):
        return None if struct.pack("<d", a) == struct.pack("<d", b) else where or "."
    return None if type(a) is type(b) and a == b else where or "."
