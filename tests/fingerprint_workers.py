"""Test-only rank entries around ``bitdet train``'s worker for the per-step digests (importable via
PYTHONPATH=tests): recorded host syncs, planted bit flips in replicas, every buffer kind flipped."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_bitdet.train.loop import StepHook
from megatron_bitdet.train.worker import enforce, worker


class _StateStorages(StepHook):
    def begin(self, step, state, batches):
        import host_sync_recorder

        host_sync_recorder.state_storages(state.ddp_modules)
        return batches


def recorded(rank: int, world_size: int, *, recipe: dict, options: dict) -> int:
    """``bitdet train``'s worker with every host transfer and scalar read recorded (host_sync_recorder)."""
    import host_sync_recorder

    host_sync_recorder.install(rank)
    return worker(rank, world_size, recipe=recipe, options=options, hooks=[_StateStorages()])


def _flip_bit(t: torch.Tensor, byte: int, bit: int) -> None:
    """Fault simulation: one bit of ``t``'s bytes flipped in place."""
    t.detach().reshape(-1).view(torch.uint8)[byte:byte + 1].bitwise_xor_(1 << bit)


def _locate(region, row: int) -> tuple[torch.Tensor, int]:
    """(tensor, byte offset in it) of the first byte of a region's row."""
    from megatron_bitdet.fingerprint.shards import ROW_BYTES

    layout = region.layout
    i = max(j for j, first in enumerate(layout.first_row) if first <= row)
    return region.tensors[i], (row - layout.first_row[i]) * ROW_BYTES


class PlantReplicaFlips(StepHook):
    """At the start of ``step``: for each ``(kind, rank, q)`` of ``flips``, one bit of ``rank``'s copy of
    region ``kind`` (``params``, ``exp_avg``: its first DDP buffer) flipped, in the largest-magnitude
    element of the region's check chunk ``q`` (slice ``q // K``, which ``rank`` must not own) -- a real
    fault in one replica's bytes that replica does not own, persistent without the distributed
    optimizer. ``out`` (JSON): the byte and step-to-be-seen of each."""

    def __init__(self, step: int, flips: list, out: str):
        self.step, self.flips, self.out = step, flips, out

    def begin(self, step, state, batches):
        if step != self.step:
            return batches
        from megatron_bitdet.fingerprint.shards import CHECK_CHUNKS, ROW_BYTES, chunk_rows, slice_rows
        from megatron_bitdet.train.step_fingerprints import ddp_regions, optimizer_regions

        regions = ddp_regions(state.ddp_modules) + optimizer_regions(state.ddp_modules, state.optimizer)
        planted = []
        for kind, rank, q in self.flips:
            region = next(r for r in regions if r.kind == kind)
            g, layout = region.group, region.layout
            owner = q // CHECK_CHUNKS
            assert owner != rank and g.size * CHECK_CHUNKS > q, (kind, rank, q)
            a, b = chunk_rows(*slice_rows(layout.rows, owner, g.size), CHECK_CHUNKS)[q % CHECK_CHUNKS]
            best = None  # (|value|, tensor, element, region byte)
            for t, first, first_byte in zip(region.tensors, layout.first_row, layout.first_byte):
                n = t.numel()
                lo = min(max(a - first, 0) * ROW_BYTES // t.element_size(), n)
                hi = min(max(b - first, 0) * ROW_BYTES // t.element_size(), n)
                if lo < hi:
                    flat = t.detach().reshape(-1)
                    i = lo + int(flat[lo:hi].abs().argmax())
                    if best is None or flat[i].abs() > best[0]:
                        best = (flat[i].abs(), t, i, first_byte + i * t.element_size())
            _, t, i, byte = best
            if torch.distributed.get_rank() == rank:
                # a float32's third byte, bit 6: its top mantissa bit, a change no update rounds away
                _flip_bit(t, i * t.element_size() + 2, 6)
            planted.append({"kind": kind, "buf": region.buf, "rank": rank, "byte": byte + 2,
                            "seen_at": step + (q - step) % (g.size * CHECK_CHUNKS)})
        if torch.distributed.get_rank() == 0:
            Path(self.out).write_text(json.dumps(planted))
        return batches


def replica_flips(rank: int, world_size: int, *, recipe: dict, options: dict, plant: dict) -> int:
    return worker(rank, world_size, recipe=recipe, options=options, hooks=[PlantReplicaFlips(**plant)])


def flip_every_kind(rank: int, world_size: int, *, recipe: dict, options: dict, out: str) -> int:
    """After one training step: for every digest kind this rank writes, one bit flipped in the bytes it
    digests (its own slice of a replicated buffer, its owned shard, its small state), the step's
    digests taken again, the bit flipped back. ``out``: {kind: [changed?, ...]} per rank."""
    from megatron_bitdet.fingerprint.shards import slice_rows
    from megatron_bitdet.train.step_fingerprints import StepDigests

    class Flipper(StepHook):
        def end(self, step, line):
            digests = StepDigests(self.state.ddp_modules, optimizer=self.state.optimizer)

            def line_digests():
                digests.grads(step)
                digests.state(step)
                return digests.resolve()[0]

            base = line_digests()
            # the same state digested again gives the line's digests (the grads aside: the optimizer may
            # have clipped them in place since the line took them)
            differ = {k for k in base if base[k] != line["digests"][k]}
            assert differ <= {"grads"} and base.keys() == line["digests"].keys(), differ
            changed = {}
            for region in digests.regions():
                g, rows = region.group, region.layout.rows
                lo, hi = (0, rows) if region.sharded or g.size == 1 else slice_rows(rows, g.index, g.size)
                if lo == hi:
                    continue
                t, offset = _locate(region, (lo + hi) // 2)
                _flip_bit(t, offset + 1, 3)
                now = line_digests()
                _flip_bit(t, offset + 1, 3)
                changed.setdefault(region.kind, []).append(now[region.kind] != base[region.kind])
            for kind, tensors in digests._small_state().items():
                if kind == "generators":  # a generator's state moved on by one draw (not a bit of its bytes:
                    gen = digests._sources[1][0][1]  # set_state ignores some of them)
                    saved = gen.get_state()
                    torch.rand(1, generator=gen)
                    now = line_digests()
                    gen.set_state(saved)
                else:
                    t = tensors[0][1]
                    _flip_bit(t, 0, 1)
                    now = line_digests()
                    _flip_bit(t, 0, 1)
                changed.setdefault(kind, []).append(now[kind] != base[kind])
            assert line_digests() == base
            Path(out, f"rank_{torch.distributed.get_rank()}.json").write_text(json.dumps(changed))
            return True

        def begin(self, step, state, batches):
            self.state = state
            return batches

    return worker(rank, world_size, recipe=recipe, options=options, hooks=[Flipper()])


for _entry in (recorded, replica_flips, flip_every_kind):
    _entry.before_process_group = enforce


class PlantMoment(StepHook):
    """On ``rank`` at ``step``, right after the optimizer's update: one bit flipped in the first Adam
    ``exp_avg`` this rank's optimizer holds (the moment is wrong; the step's params, made before it, are
    not). Where: ``out`` (JSON)."""

    def __init__(self, rank: int, step: int, out: str):
        self.rank, self.step, self.out = rank, step, out

    def begin(self, step, state, batches):
        if step == self.step and torch.distributed.get_rank() == self.rank:
            optimizer, update = state.optimizer, state.optimizer.step

            def step_then_flip():
                result = update()
                inner = getattr(optimizer, "chained_optimizers", [optimizer])[0].optimizer
                target = next(p for g in inner.param_groups for p in g["params"] if "exp_avg" in inner.state[p])
                _flip_bit(inner.state[target]["exp_avg"], 2, 6)
                Path(self.out).write_text(json.dumps({"rank": self.rank, "step": step, "numel": target.numel()}))
                optimizer.step = update
                return result

            optimizer.step = step_then_flip
        return batches


def planted_moment(rank: int, world_size: int, *, recipe: dict, options: dict, plant: dict) -> int:
    return worker(rank, world_size, recipe=recipe, options=options, hooks=[PlantMoment(**plant)])
