"""Training data through megatron-core's own datasets, with an exact, resumable data position.

Pipeline: corpus (``data_corpus``) -> indexed dataset .bin/.idx -> ``GPTDataset`` built by
``BlendedMegatronDatasetBuilder`` (seeded document and sample shuffles, megatron's index cache) ->
megatron's pretraining-sampler order: the global sample stream is cut into windows of
``micro_batch_size * dp_size`` consecutive samples and DP rank ``r`` takes the ``r``-th slice of each
window, so ``consumed_samples`` (a global count) advances by ``global_batch_size`` per step and is
the whole data position. Under ``determinism.reductions: dp_invariant`` the windows are cut for the
``virtual_dp`` virtual ranks and a rank draws, per step, all micro-batches of each virtual rank it hosts
in turn (at DP = virtual_dp: the order above).

Caches live under ``cache_dir/<corpus digest>/`` (default ``~/.cache/megatron_bitdet/data``): the
.bin/.idx plus ``index/<key>/`` for megatron's shuffle indices. Rank 0 builds under a file lock
(other processes wait on the lock, other ranks on rank 0) and publishes atomically; a torn or
corrupt cache fails its digest manifest and is rebuilt. With several ranks the cache dir must be
one all ranks see (like megatron's ``--data-cache-path``); the default suits one machine.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import xxhash
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.kernels.reductions import bit_reversed
from megatron_bitdet.train.data_cache import file_lock, files_manifest, manifest_matches, read_json, write_json_atomic
from megatron_bitdet.train.data_corpus import PREFIX, ensure_indexed, read_corpus
from megatron_bitdet.train.data_tokenizer import ByteTokenizer

DEFAULT_MAX_BYTES = 16 << 20
_INDEX_MARKER = "complete.json"


@dataclass(frozen=True)
class DataConfig:
    """The recipe's ``data`` section plus the knobs the recipe does not (yet) carry."""

    corpus: str = "python-stdlib"
    tokenizer: str = "byte"
    cache_dir: str | None = None
    split: str = "98,1,1"
    max_bytes: int = DEFAULT_MAX_BYTES
    create_attention_mask: bool = True

    def __post_init__(self) -> None:
        if self.tokenizer != "byte":
            raise BitdetInputError(f"data.tokenizer: only 'byte' is supported, got {self.tokenizer!r}")

    @classmethod
    def coerce(cls, cfg) -> "DataConfig":
        """Accept a DataConfig, a mapping, or any object with the recipe's attribute names."""
        if isinstance(cfg, cls):
            return cfg
        get = cfg.get if isinstance(cfg, Mapping) else (lambda k, d: getattr(cfg, k, d))
        return cls(**{f.name: get(f.name, f.default) for f in fields(cls)})


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "megatron_bitdet" / "data"


class TrainData:
    """Iterator of this DP rank's micro-batches (CPU tensors, megatron ``get_batch`` layout).

    Each item: ``tokens``, ``labels`` (int64 [b, s]), ``loss_mask`` (float32 [b, s]),
    ``attention_mask`` (bool [b, 1, s, s], True = masked, or None), ``position_ids`` (int64 [b, s]).
    Pass it as megatron's ``data_iterator``: one step pulls ``num_microbatches`` items.
    """

    def __init__(self, dataset: GPTDataset, valid_dataset, *, identity: dict, micro_batch_size: int,
                 dp_rank: int, dp_size: int, corpus_dir: Path, rebuilt: bool, virtual_dp: int | None = None) -> None:
        self.dataset = dataset
        self.valid_dataset = valid_dataset
        self.identity = identity  # what a saved data position is only valid for
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.virtual_dp = virtual_dp or dp_size  # the ranks the windows are cut for (dp_invariant)
        self.corpus_dir = corpus_dir
        self.rebuilt = rebuilt  # whether this call (re)built the .bin/.idx
        self.consumed_samples = 0
        self._drawn = 0  # micro-batches drawn in the step in flight

    @property
    def corpus_digest(self) -> str:
        return self.identity["corpus_digest"]

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per (virtual) rank per step."""
        return self.identity["global_batch_size"] // (self.micro_batch_size * self.virtual_dp)

    @property
    def window(self) -> int:
        return self.micro_batch_size * self.virtual_dp

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        """Micro-batch ``j`` of the ``e``-th hosted virtual rank to run, ``v = dp_rank + h * dp_size`` with
        ``h`` the bit-reversal of ``e`` (``train.reductions.VirtualLayout``): slice ``v`` of the step's
        window ``j``. ``consumed_samples`` advances a window per draw of the last one to run (with one
        hosted: every draw), so at a step's end it has advanced by the global batch."""
        hosted = self.virtual_dp // self.dp_size
        e, j = divmod(self._drawn, self.num_microbatches)
        base = self.consumed_samples + (j * self.window if e < hosted - 1 else 0)
        if base + self.window > len(self.dataset):
            raise StopIteration
        start = base + (self.dp_rank + bit_reversed(hosted)[e] * self.dp_size) * self.micro_batch_size
        samples = [self.dataset[i] for i in range(start, start + self.micro_batch_size)]
        self._drawn = (self._drawn + 1) % (hosted * self.num_microbatches)
        if e == hosted - 1:
            self.consumed_samples += self.window
        batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
        batch.setdefault("attention_mask", None)
        return batch

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, **self.identity}

    def load_state_dict(self, state: Mapping) -> None:
        """Resume at a saved position; refuses a position saved for other data or another order."""
        diff = {k: (state.get(k), v) for k, v in self.identity.items() if state.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise BitdetInputError(f"data position was saved for different data: {detail}")
        consumed = state.get("consumed_samples")
        window = self.window
        if not isinstance(consumed, int) or consumed < 0 or consumed % window or consumed > len(self.dataset):
            raise BitdetInputError(
                f"data position consumed_samples={consumed!r} is not a multiple of micro_batch_size x dp_size"
                f" = {window} within the dataset's {len(self.dataset)} samples"
            )
        self.consumed_samples, self._drawn = consumed, 0


def _check_sizes(seq_length, micro_batch_size, global_batch_size, dp_rank, dp_size, train_samples,
                 virtual_dp) -> None:
    if min(seq_length, micro_batch_size, global_batch_size, dp_size, train_samples, virtual_dp) <= 0:
        raise BitdetInputError("seq_length, batch sizes, dp_size, virtual_dp and train_samples must be positive")
    if not 0 <= dp_rank < dp_size:
        raise BitdetInputError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
    if virtual_dp % dp_size:
        raise BitdetInputError(f"virtual_dp {virtual_dp} is not a multiple of dp_size {dp_size}")
    if global_batch_size % (micro_batch_size * virtual_dp):
        raise BitdetInputError(
            f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size {micro_batch_size}"
            f" x dp_size {virtual_dp}"
        )


def _prepare_index_dir(index_dir: Path) -> bool:
    """Clear a torn megatron index cache (no valid marker) so megatron rebuilds it; True if cleared."""
    marker = read_json(index_dir / _INDEX_MARKER)
    if marker and manifest_matches(index_dir, marker.get("files", {})):
        return False
    shutil.rmtree(index_dir, ignore_errors=True)
    return True


def _broadcast_from_rank0(payload, dist: bool):
    if not dist:
        return payload
    box = [payload]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def build_train_data(data_cfg, *, seq_length: int, seed: int, micro_batch_size: int,
                     global_batch_size: int, dp_rank: int, dp_size: int, train_samples: int,
                     cache_dir: str | os.PathLike | None = None, virtual_dp: int | None = None) -> TrainData:
    """Build (or reuse) the cached dataset and return this DP rank's resumable micro-batch iterator
    (``virtual_dp``: the virtual ranks it hosts a share of, ``determinism.virtual_dp``).

    Collective when torch.distributed is initialized: every rank of the world must call it (rank 0
    builds, the others wait for it). With NCCL, set the CUDA device first (object broadcast).
    """
    cfg = DataConfig.coerce(data_cfg)
    _check_sizes(seq_length, micro_batch_size, global_batch_size, dp_rank, dp_size, train_samples,
                 virtual_dp or dp_size)
    root = Path(cache_dir or cfg.cache_dir or default_cache_dir()).expanduser().resolve()
    sizes = [train_samples, None, None]
    index_key = xxhash.xxh3_64_hexdigest(repr((seed, seq_length, cfg.split, sizes)).encode())
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if dist else 0

    with contextlib.ExitStack() as stack:
        payload = None
        if rank == 0:
            try:
                corpus = read_corpus(cfg.corpus, cfg.max_bytes)
                corpus_dir = root / corpus.digest
                stack.enter_context(file_lock(root / f"{corpus.digest}.lock"))
                rebuilt = ensure_indexed(corpus, corpus_dir)
                new_index = _prepare_index_dir(corpus_dir / "index" / index_key)
                payload = {"digest": corpus.digest, "dir": str(corpus_dir), "rebuilt": rebuilt}
            except Exception as exc:
                error = {"error": f"{type(exc).__name__}: {exc}", "input": isinstance(exc, BitdetInputError)}
                _broadcast_from_rank0(error, dist)
                raise
        payload = _broadcast_from_rank0(payload, dist)
        if "error" in payload:
            cls = BitdetInputError if payload["input"] else BitdetError
            raise cls(f"rank 0 could not prepare the training data: {payload['error']}")
        corpus_dir = Path(payload["dir"])
        index_dir = corpus_dir / "index" / index_key
        config = GPTDatasetConfig(
            random_seed=seed, sequence_length=seq_length, blend=([str(corpus_dir / PREFIX)], None),
            split=cfg.split, path_to_cache=str(index_dir), tokenizer=ByteTokenizer(),
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
            create_attention_mask=cfg.create_attention_mask,
        )
        train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
        if rank == 0 and new_index:
            names = [p.name for p in index_dir.iterdir() if p.name != _INDEX_MARKER]
            write_json_atomic(index_dir / _INDEX_MARKER, {"files": files_manifest(index_dir, names)})

    identity = {"corpus_digest": payload["digest"], "index": index_key, "seed": seed,
                "seq_length": seq_length, "global_batch_size": global_batch_size}
    return TrainData(train, valid, identity=identity, micro_batch_size=micro_batch_size,
                     dp_rank=dp_rank, dp_size=dp_size, corpus_dir=corpus_dir, rebuilt=payload["rebuilt"],
                     virtual_dp=virtual_dp)
