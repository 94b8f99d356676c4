"""Test-only workers that ``launch`` runs in real child processes (importable via PYTHONPATH=tests)."""
import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _touch(path):
    Path(path).write_text("helper ran")


def allreduce(rank, world_size, out):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if rank == 0:  # like dist_checkpointing's async save: a spawn-started helper re-imports __main__
        helper = multiprocessing.get_context("spawn").Process(target=_touch, args=(Path(out, "helper"),))
        helper.start()
        helper.join()
        assert helper.exitcode == 0
    print(f"rank {rank} sum {t.item()}", flush=True)
    Path(out, f"rank_{rank}.json").write_text(json.dumps(
        {"sum": t.item(), "backend": dist.get_backend(), "pid": os.getpid(),
         "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                "MASTER_ADDR", "BITDET_TEST_MARK")}}))


def raise_on(rank, world_size, bad_rank):
    if rank == bad_rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    dist.barrier()  # would wait forever for the failed rank: the launcher must end it


def sigkill_on(rank, world_size, bad_rank):
    if rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def fail_then_peer_killed(rank, world_size):
    """The race a killed rank can lose: its peer's error exit is seen first, its SIGKILL a moment later."""
    if rank == 0:
        raise RuntimeError("peer vanished")
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)


def pid_then_wait(rank, world_size, out):
    """Writes its pid, then waits in a collective its peers never join: only a signal ends it."""
    Path(out, f"pid_{rank}").write_text(str(os.getpid()))
    if rank == 0:
        dist.barrier()
    time.sleep(600)


def build_data(rank, world_size, cache_dir, out, max_bytes, steps):
    """Every rank builds the same fresh cache concurrently, then dumps its DP slice."""
    from megatron_bitdet.train.data import build_train_data

    td = build_train_data({"corpus": "python-stdlib", "max_bytes": max_bytes}, seq_length=32, seed=7,
                          micro_batch_size=2, global_batch_size=4 * world_size, dp_rank=rank,
                          dp_size=world_size, train_samples=64, cache_dir=cache_dir)
    batches = [next(td)["tokens"] for _ in range(steps * td.num_microbatches)]
    torch.save({"tokens": batches, "digest": td.corpus_digest, "state": td.state_dict()},
               Path(out, f"rank_{rank}.pt"))


def hash_state(rank, world_size, out):
    """What this rank's interpreter really hashes str with (fixed when it started)."""
    import sys

    Path(out, "worker.json").write_text(json.dumps(
        {"hash_randomization": sys.flags.hash_randomization, "hash": hash("bitdet"), "pid": os.getpid(),
         "env": os.environ.get("PYTHONHASHSEED")}))


CUDA_EVENTS = []  # filled by test_launch's stand-in for torch.cuda and by the worker below


def cuda_order(rank, world_size):
    CUDA_EVENTS.append("worker")


def _enforce(rank, world_size):
    CUDA_EVENTS.append("enforce")


cuda_order.before_process_group = _enforce


def cuda_order_own_group(rank, world_size):
    """Like Megatron-LM's rank entry: enforcement and the device are the script's own business."""
    CUDA_EVENTS.append("worker")


cuda_order_own_group.owns_process_group = True
