"""Start N ranks of a worker on this machine (or join torchrun's), with clean failure propagation.

``launch("pkg.module:function", nproc, args)`` spawns ``nproc`` fresh interpreters
(``python -m megatron_bitdet.train.launch``), each with MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE set; the child initializes the default process group ("nccl" when
CUDA is available, else "gloo"; one code path) and calls ``function(rank, world_size, **args)``
(or ``*args`` for a list). Its return value, if an int, is the rank's exit code.

Fresh interpreters (not fork) because the determinism environment must be in place before torch,
cuBLAS or NCCL are first imported/initialized: the children get the parent's environment plus
``env``, from their first instruction. The child entry lives behind a ``__main__`` guard in an
importable module, so multiprocessing helpers that re-import it (dist_checkpointing's async save)
do not re-run it.

When one rank fails (exception, nonzero exit, killed by a signal) the others are terminated at once
(whole process groups, so their helper processes go too) and ``launch`` returns nonzero after saying
which rank failed and showing the last lines of its stderr. Rank 0 streams to the console; with
``run_dir`` every rank's stdout+stderr also goes to ``RUN_DIR/logs/rank_XXXXX.log``.

Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK already set) nothing is spawned: the worker runs in
this process for this rank (``env`` is applied to ``os.environ`` first, which reaches libraries not yet
initialized; a rank whose str hashing is not ``env``'s PYTHONHASHSEED is re-executed in place, see
:func:`adopt_env`), and torchrun's own ``--log-dir``/``--tee`` handle logs. Nothing here touches CUDA
before the worker's ``before_process_group`` hook (enforcement) has run.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.rundir import log_path, logs_dir

TAIL_LINES = 20
TERMINATE_GRACE_S = 5.0
CULPRIT_GRACE_S = 1.0
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_REEXEC_MARK = "BITDET_REEXECUTED"  # set across adopt_env's one re-exec of a rank


def under_torchrun(environ=None) -> bool:
    """True when an outer launcher (torchrun, SLURM wrappers) already made this process a rank."""
    environ = os.environ if environ is None else environ
    return all(k in environ for k in _TORCHRUN_VARS)


def resolve_worker(path: str):
    """``"pkg.module:function"`` -> the callable; a clear BitdetInputError otherwise."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise BitdetInputError(f"worker {path!r} must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise BitdetInputError(f"cannot load worker {path!r}: {exc}") from exc
    if not callable(fn):
        raise BitdetInputError(f"worker {path!r} is not callable")
    return fn


@contextlib.contextmanager
def collector_paused():
    """A rank's startup (torch, megatron-core and the worker's modules, the model) builds millions of
    long-lived objects, and the cyclic collector would traverse them again and again while they are
    built (about a fifth of a tiny 2-rank launch's CPU). Paused for the block, then everything that
    exists is frozen out of later collections; what the rank allocates afterwards is collected as usual."""
    if not gc.isenabled():  # inside another pause: that one freezes and resumes
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def run_rank(worker_path: str, args, backend: str | None = None, *, fresh_interpreter: bool = False) -> int:
    """This process's rank: init the default process group, run the worker, tear the group down.
    ``fresh_interpreter``: the process was started for this rank (a spawned child): its startup runs
    with the cyclic collector paused (:func:`collector_paused`)."""
    from megatron_bitdet.compat.cpu_backend import eager_jit_fuser

    eager_jit_fuser()  # before the worker's module can import megatron.core (no-op on a GPU)
    with collector_paused() if fresh_interpreter else contextlib.nullcontext():
        fn = resolve_worker(worker_path)
        import torch
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        before = getattr(fn, "before_process_group", None)
        if before is not None:  # determinism enforcement: before the CUDA context and the communicators
            before(rank, world, **args) if isinstance(args, dict) else before(rank, world, *args)
        if not getattr(fn, "owns_process_group", False):  # e.g. Megatron-LM's initialize: device and group
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"),
                                    rank=rank, world_size=world)
    result = fn(rank, world, **args) if isinstance(args, dict) else fn(rank, world, *args)
    # Teardown only on success: destroying the group while raising would make the peers fail
    # first and hide which rank was the culprit (the launcher names the first rank to exit).
    if dist.is_initialized():
        dist.destroy_process_group()
    return result if isinstance(result, int) else 0


def _rendezvous_store(nproc: int):
    """The ranks' TCPStore, hosted here on a port the OS picked and this process keeps bound: every
    rank joins it as a client (TORCHELASTIC_USE_AGENT_STORE, as under torchrun). A port found free and
    handed to rank 0 to bind later can be taken in between (another launch's ranks, gloo's sockets)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)


class _Rank:
    """One child process plus the threads that copy its output to the log, console and stderr tail."""

    def __init__(self, rank: int, cmd: list[str], env: dict, log_path: Path | None, console: bool) -> None:
        self.rank = rank
        self.tail = collections.deque(maxlen=TAIL_LINES)
        self.log = open(log_path, "wb") if log_path else None
        self._log_lock = threading.Lock()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.pumps = [threading.Thread(target=self._pump, args=(s, c, t), daemon=True) for s, c, t in (
            (self.proc.stdout, sys.stdout if console else None, False),
            (self.proc.stderr, sys.stderr if console else None, True))]
        for t in self.pumps:
            t.start()

    def _pump(self, stream, console, keep_tail: bool) -> None:
        for line in iter(stream.readline, b""):
            if self.log:
                with self._log_lock:
                    self.log.write(line)
                    self.log.flush()
            text = line.decode("utf-8", errors="replace")
            if keep_tail:
                self.tail.append(text.rstrip("\n"))
            if console:
                console.write(text)
                console.flush()

    def kill_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        for t in self.pumps:
            t.join(timeout=2.0)  # a lingering grandchild may hold the pipe open: don't wait on it
        if self.log:
            with self._log_lock:
                self.log.close()


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _spawn_all(worker_fn_path, nproc, args, backend, run_dir, env, console_rank) -> int:
    try:
        args_json = json.dumps(args)
    except TypeError as exc:
        raise BitdetInputError(f"worker args must be JSON-serializable: {exc}") from exc
    if run_dir is not None:
        logs_dir(run_dir).mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "megatron_bitdet.train.launch", worker_fn_path, args_json, backend or ""]
    store = _rendezvous_store(nproc)
    base = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "PYTHONUNBUFFERED": "1"}
    ranks: list[_Rank] = []
    exits: queue.Queue = queue.Queue()
    try:
        for r in range(nproc):
            rank = _Rank(r, cmd, {**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                         log_path(run_dir, r) if run_dir is not None else None, console=r == console_rank % nproc)
            ranks.append(rank)
            threading.Thread(target=lambda k=rank: exits.put((k, k.proc.wait())), daemon=True).start()
        for i in range(nproc):  # exit order as it happens: the first failure is the culprit
            rank, rc = exits.get()
            if rc != 0:
                rank, rc = _culprit(rank, rc, exits, nproc - i - 1)
                _report(rank, rc, nproc, run_dir)
                return rc if rc > 0 else 128 - rc
        return 0
    finally:
        if any(k.proc.poll() is None for k in ranks):
            for k in ranks:
                k.kill_group(signal.SIGTERM)
            for k in ranks:
                try:
                    k.proc.wait(timeout=TERMINATE_GRACE_S)
                except subprocess.TimeoutExpired:
                    k.kill_group(signal.SIGKILL)
                    k.proc.wait()
        for k in ranks:
            k.close()


def _culprit(rank: _Rank, rc: int, exits: queue.Queue, running: int) -> tuple[_Rank, int]:
    """The failed rank to name: the first failure seen, unless another rank was killed by a signal
    within a moment of it. A rank killed outright (the OOM killer's SIGKILL, a segfault) takes its
    peers down with a collective error, and which of those exits the waiting threads report first
    is a race the killed rank can lose."""
    deadline = time.monotonic() + CULPRIT_GRACE_S
    for _ in range(running if rc > 0 else 0):
        try:
            other, code = exits.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if code < 0 and code != -signal.SIGABRT:  # an abort is how a C++ collective error exits
            return other, code
    return rank, rc


def _report(rank: _Rank, rc: int, nproc: int, run_dir) -> None:
    rank.close()  # drain its output first so the tail is complete
    lines = [f"bitdet launch: rank {rank.rank} of {nproc} failed ({_describe(rc)}); terminating the other ranks."]
    if rank.tail:
        lines.append(f"last lines of rank {rank.rank}'s stderr:")
        lines += [f"  | {t}" for t in rank.tail]
    if run_dir is not None:
        lines.append(f"full log: {log_path(run_dir, rank.rank)}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def launch(worker_fn_path: str, nproc: int, args, *, backend: str | None = None,
           run_dir: str | os.PathLike | None = None, env: dict | None = None, console_rank: int = 0) -> int:
    """Run ``worker_fn_path`` on ``nproc`` ranks; 0 when every rank succeeded, else the failing rank's code.

    ``args`` (dict -> keyword arguments, list -> positional) must be JSON-serializable.
    ``env`` is added to the children's environment before their interpreter starts.
    ``console_rank`` is the rank streamed to this console (-1: the last, which holds the loss
    under pipeline parallelism).
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise BitdetInputError(f"nproc must be a positive integer, got {nproc!r}")
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != nproc:
            raise BitdetInputError(f"torchrun started {world} processes but this run needs {nproc}")
        adopt_env(env or {})
        return run_rank(worker_fn_path, args, backend)
    return _spawn_all(worker_fn_path, nproc, args, backend, run_dir, env, console_rank)


def adopt_env(env: dict) -> None:
    """Put ``env`` into this already-started rank (torchrun's). ``os.environ`` reaches the libraries
    that read it at first use, but str hashing was fixed when the interpreter started: a rank that does
    not hash with the PYTHONHASHSEED asked for is re-executed, same command line, with ``env`` in place
    (same PID, so torchrun keeps supervising it). If even that does not take, refuse with the fix."""
    from megatron_bitdet.enforce.env import hash_seed_in_effect

    os.environ.update(env)
    wanted = env.get("PYTHONHASHSEED")
    if wanted is None or not wanted.isdigit() or hash_seed_in_effect() == str(int(wanted)):
        os.environ.pop(_REEXEC_MARK, None)
        return
    if os.environ.get(_REEXEC_MARK):
        raise BitdetInputError(
            f"this rank still hashes str randomly after a re-exec with PYTHONHASHSEED={wanted} (python -E or -I "
            f"ignores the variable): start every rank with it exported and without -E/-I, e.g. "
            f"PYTHONHASHSEED={wanted} torchrun ...")
    os.environ[_REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)


def _child_main(argv: list[str]) -> int:
    worker_path, args_json, backend = argv
    try:
        return run_rank(worker_path, json.loads(args_json), backend or None, fresh_interpreter=True)
    except BitdetError as exc:
        print(f"rank {os.environ.get('RANK')}: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
