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

Through a cluster launcher (:class:`Launcher`, ``--launcher``; :func:`through` makes it the one every
``launch`` in the block uses, so each workflow's launches go there unchanged): bitdet runs each template
once per launch from this process, with the rank program appended (one template per node for torchrun,
each led by what places it on its node; one for ``srun``, which starts every node itself). What the ranks
must have (``env``: the canonical determinism environment; srun's rendezvous) is put on the command line
as ``/usr/bin/env K=V ...`` right before torchrun, or before the rank program under srun, so it reaches
remote ranks whatever the prefix or the cluster hands on (``srun --export=NONE`` included); the rank
program gets the same values as an argument and refuses to start (exit 2, naming them) when its
environment lacks one or differs. Each rank tees its own output to ``RUN_DIR/logs/rank_XXXXX.log``;
RUN_DIR must be on a filesystem every node mounts at the same path (as Megatron's checkpoints need): a
rank that does not see the ``logs`` folder bitdet made before the launch refuses, naming its host, and a
launch that leaves a rank's log out of it fails, naming the file.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import importlib
import io
import json
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.rundir import log_path, logs_dir

TAIL_LINES = 20
TERMINATE_GRACE_S = 5.0
CULPRIT_GRACE_S = 1.0
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_REEXEC_MARK = "BITDET_REEXECUTED"  # set across adopt_env's one re-exec of a rank
_RANK_PROGRAM = "megatron_bitdet.train.launch"
_ENV_PROGRAM = "/usr/bin/env"  # by absolute path: a rank started with srun --export=NONE has no PATH


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


class _Proc:
    """One child process (a rank, or a launcher template's) plus the threads that copy its output to the
    log, console and stderr tail."""

    def __init__(self, name: str, cmd: list[str], env: dict, log_path: Path | None, console: bool) -> None:
        self.name, self.log_path = name, log_path
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
    cmd = [sys.executable, *_rank_program(worker_fn_path, args, backend, env or {}, None)]
    if run_dir is not None:
        logs_dir(run_dir).mkdir(parents=True, exist_ok=True)
    store = _rendezvous_store(nproc)
    base = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "PYTHONUNBUFFERED": "1"}
    return _supervise([(f"rank {r}", cmd, {**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                        log_path(run_dir, r) if run_dir is not None else None, r == console_rank % nproc)
                       for r in range(nproc)])


def _rank_program(worker_fn_path: str, args, backend, env: dict, tee_dir) -> list[str]:
    """The rank program's argv after the interpreter: the worker, its arguments, the backend, the
    environment the rank must have started with (checked by :func:`_refuse_unforwarded`) and the run
    directory a launcher's rank tees its log into ("" for a spawned rank, whose parent writes it)."""
    return ["-m", _RANK_PROGRAM, worker_fn_path, _args_json(args), backend or "", json.dumps(env, sort_keys=True),
            "" if tee_dir is None else os.path.abspath(tee_dir)]


def _args_json(args) -> str:
    try:
        return json.dumps(args)
    except TypeError as exc:
        raise BitdetInputError(f"worker args must be JSON-serializable: {exc}") from exc


def _supervise(specs: list) -> int:
    """Start every (name, cmd, env, log, console) process; 0 when all exit 0, else the first failure's
    code after terminating the rest."""
    with _sigterm_ends_here():
        return _supervise_procs(specs)


@contextlib.contextmanager
def _sigterm_ends_here():
    """A SIGTERM to the launcher (``timeout``, ``scancel``, a job's end) exits through the ``finally`` that
    ends the ranks: Python's default action would leave them running, their process groups being their own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_on(signum, frame):
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, exit_on)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _supervise_procs(specs: list) -> int:
    procs: list[_Proc] = []
    exits: queue.Queue = queue.Queue()
    try:
        for spec in specs:
            proc = _Proc(*spec)
            procs.append(proc)
            threading.Thread(target=lambda k=proc: exits.put((k, k.proc.wait())), daemon=True).start()
        for i in range(len(procs)):  # exit order as it happens: the first failure is the culprit
            proc, rc = exits.get()
            if rc != 0:
                proc, rc = _culprit(proc, rc, exits, len(procs) - i - 1)
                _report(proc, rc, len(procs))
                return rc if rc > 0 else 128 - rc
        return 0
    finally:
        if any(k.proc.poll() is None for k in procs):
            for k in procs:
                k.kill_group(signal.SIGTERM)
            for k in procs:
                try:
                    k.proc.wait(timeout=TERMINATE_GRACE_S)
                except subprocess.TimeoutExpired:
                    k.kill_group(signal.SIGKILL)
                    k.proc.wait()
        for k in procs:
            k.close()


def _culprit(rank: _Proc, rc: int, exits: queue.Queue, running: int) -> tuple[_Proc, int]:
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


def _report(proc: _Proc, rc: int, total: int) -> None:
    proc.close()  # drain its output first so the tail is complete
    others = proc.name.split()[0] + "s"
    lines = [f"bitdet launch: {proc.name} of {total} failed ({_describe(rc)}); terminating the other {others}."]
    if proc.tail:
        lines.append(f"last lines of {proc.name}'s stderr:")
        lines += [f"  | {t}" for t in proc.tail]
    if proc.log_path is not None:
        lines.append(f"full log: {proc.log_path}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def launch(worker_fn_path: str, nproc: int, args, *, backend: str | None = None,
           run_dir: str | os.PathLike | None = None, env: dict | None = None, console_rank: int = 0) -> int:
    """Run ``worker_fn_path`` on ``nproc`` ranks; 0 when every rank succeeded, else the failing rank's code.

    ``args`` (dict -> keyword arguments, list -> positional) must be JSON-serializable.
    ``env`` is added to the children's environment before their interpreter starts.
    ``console_rank`` is the rank streamed to this console (-1: the last, which holds the loss
    under pipeline parallelism). Inside :func:`through` the ranks start through that launcher.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise BitdetInputError(f"nproc must be a positive integer, got {nproc!r}")
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != nproc:
            raise BitdetInputError(f"torchrun started {world} processes but this run needs {nproc}")
        adopt_env(env or {})
        return run_rank(worker_fn_path, args, backend)
    if _LAUNCHER is not None:
        return _LAUNCHER.run(worker_fn_path, nproc, args, backend=backend, run_dir=run_dir, env=env)
    return _spawn_all(worker_fn_path, nproc, args, backend, run_dir, env, console_rank)


LAUNCHER_FLAG = "--launcher"
LAUNCHER_PROGRAMS = ("torchrun", "srun")


@dataclass(frozen=True)
class Launcher:
    """A cluster launch template (``--launcher``, one value per node for torchrun; one in all for srun):
    what each starts, validated before any rank starts. ``program``: the one that starts the ranks
    (torchrun, also when an ``srun`` prefix starts one torchrun per node; else srun)."""

    templates: tuple
    program: str
    nnodes: int
    nproc_per_node: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def describe(self) -> str:
        return f"{self.nnodes} node(s) x {self.nproc_per_node} rank(s) through {self.program}"

    def check_world(self, nproc: int, what: str = "--nproc") -> None:
        if nproc != self.world_size:
            raise BitdetInputError(f"{LAUNCHER_FLAG} starts {self.world_size} ranks (--nnodes {self.nnodes} x "
                                   f"{'--nproc-per-node' if self.program == 'torchrun' else '--ntasks-per-node'} "
                                   f"{self.nproc_per_node}) but {what} is {nproc}: make them agree")

    def run(self, worker_fn_path: str, nproc: int, args, *, backend=None, run_dir=None, env=None) -> int:
        """One launch: every template with what the ranks need forwarded on its command line and the rank
        program appended, supervised as the local ranks are; then every rank's log must be in RUN_DIR (the
        run directory collected from every node)."""
        self.check_world(nproc, "this run's world size")
        forward = {**(env or {}), "PYTHONUNBUFFERED": "1"}
        if self.program == "srun":  # srun starts bare ranks: they join this process's store
            store = _rendezvous_store(nproc)
            forward.update(MASTER_ADDR=socket.gethostname(), MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
                           TORCHELASTIC_USE_AGENT_STORE="True", LOCAL_WORLD_SIZE=str(self.nproc_per_node))
        if run_dir is not None:
            logs_dir(run_dir).mkdir(parents=True, exist_ok=True)
        rank = _rank_program(worker_fn_path, args, backend, forward, run_dir)
        prefix = [_ENV_PROGRAM, *(f"{k}={v}" for k, v in forward.items())]
        base = {**os.environ, **forward}
        rc = _supervise([(f"node {i}", self._command(t, prefix, rank), base, None, True)
                         for i, t in enumerate(self.templates)])
        if run_dir is not None:
            missing = [r for r in range(nproc) if not log_path(run_dir, r).is_file()]
            if missing and rc == 0:
                raise BitdetError(
                    f"{LAUNCHER_FLAG}: rank(s) {missing} exited 0 but {_named_logs(run_dir, missing)} is not here: "
                    f"each rank writes it into the {logs_dir(run_dir)} its own node sees, which held a folder "
                    "that is not this one (the run directory must be one filesystem every node mounts at the "
                    "same path, not a folder of the same name on each node)")
            if missing:
                print(f"bitdet launch: no log from rank(s) {missing} ({_named_logs(run_dir, missing)}): they did "
                      "not start, or refused before writing one (their reason is above)", file=sys.stderr, flush=True)
        return rc

    def _command(self, template: tuple, prefix: list, rank: list) -> list:
        """``template`` with ``prefix`` (``env K=V ...``) right before the program that starts the ranks'
        interpreters (torchrun, whose ranks inherit its environment; srun's rank program itself) and the
        rank program appended."""
        if self.program == "srun":
            return [*template, *prefix, sys.executable, *rank]
        at = [os.path.basename(t) for t in template].index("torchrun")
        return [*template[:at], *prefix, *template[at:], *rank]


_LAUNCHER: Launcher | None = None


@contextlib.contextmanager
def through(launcher: Launcher | None):
    """Every :func:`launch` in the block starts its ranks through ``launcher`` (None: local spawn)."""
    global _LAUNCHER
    before, _LAUNCHER = _LAUNCHER, launcher
    try:
        yield
    finally:
        _LAUNCHER = before


def parse_launcher(values) -> Launcher | None:
    """``--launcher`` values -> a Launcher; BitdetInputError (exit 2) naming the flag and the option at
    fault: no torchrun/srun in it, torchrun without --nproc-per-node or with an elastic --nnodes, srun
    without --nodes/--ntasks-per-node, a program already named after the options, or a template count
    other than one per node."""
    if not values:
        return None
    parsed = []
    for value in values:
        try:
            tokens = shlex.split(value)
        except ValueError as exc:
            raise BitdetInputError(f"{LAUNCHER_FLAG} {value!r}: {exc}") from None
        names = [os.path.basename(t) for t in tokens]
        found = [n for n in LAUNCHER_PROGRAMS if n in names]
        if not found:
            raise BitdetInputError(f"{LAUNCHER_FLAG} {value!r}: unknown launcher program "
                                   f"{(tokens or [''])[0]!r}: expected torchrun or srun (after a prefix that places "
                                   "it on its node, if any)")
        srun = _srun_layout(value, tokens[names.index("srun") + 1:]) if "srun" in found else None
        if "torchrun" in found:
            at = names.index("torchrun")
            nnodes, per_node = _torchrun_layout(value, tokens[at + 1:])
            if srun is not None and (srun[0] != nnodes or srun[1] not in (None, 1)):
                raise BitdetInputError(f"{LAUNCHER_FLAG} {value!r}: srun starting torchrun needs --nodes "
                                       f"{nnodes} (torchrun's --nnodes) and one task per node")
            parsed.append((tuple(tokens), "torchrun", nnodes, per_node, srun is not None))
        else:
            if srun[1] is None:
                raise BitdetInputError(f"{LAUNCHER_FLAG} {value!r}: srun needs --ntasks-per-node (ranks per node)")
            parsed.append((tuple(tokens), "srun", srun[0], srun[1], True))
    layouts = {(prog, nnodes, per) for _, prog, nnodes, per, _ in parsed}
    if len(layouts) > 1:
        raise BitdetInputError(f"{LAUNCHER_FLAG}: the templates disagree on the layout {sorted(layouts)}")
    (program, nnodes, per_node), = layouts
    fans_out = parsed[0][4]
    wanted = 1 if fans_out else nnodes
    if len(parsed) != wanted:
        raise BitdetInputError(
            f"{LAUNCHER_FLAG} given {len(parsed)} time(s): " + ("srun starts every node, give it once" if fans_out else
                                                                f"torchrun --nnodes {nnodes} needs one template per node "
                                                                "(each led by what runs it there), or an srun prefix"))
    return Launcher(tuple(t for t, *_ in parsed), program, nnodes, per_node)


def _torchrun_layout(value: str, options: list) -> tuple[int, int]:
    """torchrun's own parser over the template's options: (nnodes, nproc per node)."""
    from torch.distributed.run import get_args_parser

    if not any(o.split("=", 1)[0] in ("--nproc-per-node", "--nproc_per_node") for o in options):
        raise BitdetInputError(f"{LAUNCHER_FLAG} {value!r}: torchrun needs --nproc-per-node (ranks per node)")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = get_args_parser().parse_args([*options, "-m", _RANK_PROGRAM])
    except SystemExit:
        raise BitdetInputError(f"{LAUNCHER_FLAG} {value!r}: torchrun refuses its options: "
                               f"{err.getvalue().strip().rpartition('error:')[2].strip()}") from None
    if ns.training_script != _RANK_PROGRAM or ns.no_python or ns.run_path:
        raise BitdetInputError(f"{LAUNCHER_FLAG} {value!r}: end the template with torchrun's options (no program, "
                               "--no-python or --run-path): bitdet appends the rank program")
    lo, _, hi = str(ns.nnodes).partition(":")
    if not lo.isdigit() or (hi and hi != lo) or int(lo) < 1:
        raise BitdetInputError(f"{LAUNCHER_FLAG} {value!r}: --nnodes {ns.nnodes}: a fixed node count is needed")
    if not str(ns.nproc_per_node).isdigit() or int(ns.nproc_per_node) < 1:
        raise BitdetInputError(f"{LAUNCHER_FLAG} {value!r}: --nproc-per-node {ns.nproc_per_node}: a number of "
                               "ranks is needed")
    return int(lo), int(ns.nproc_per_node)


def _srun_layout(value: str, options: list) -> tuple[int, int | None]:
    """srun's --nodes/-N and --ntasks-per-node from the template: (nodes, tasks per node or None)."""
    found = {}
    for i, opt in enumerate(options):
        for key, names in (("nodes", ("--nodes", "-N")), ("per_node", ("--ntasks-per-node",))):
            for name in names:
                if opt == name and i + 1 < len(options):
                    found[key] = options[i + 1]
                elif opt.startswith(name + "=") or (name == "-N" and opt.startswith("-N") and len(opt) > 2):
                    found[key] = opt.split("=", 1)[1] if "=" in opt else opt[2:]
    for key, flag in (("nodes", "--nodes"), ("per_node", "--ntasks-per-node")):
        if key in found and not (found[key].isdigit() and int(found[key]) > 0):
            raise BitdetInputError(f"{LAUNCHER_FLAG} {value!r}: srun {flag} {found[key]}: a fixed count is needed")
    if "nodes" not in found:
        raise BitdetInputError(f"{LAUNCHER_FLAG} {value!r}: srun needs --nodes (-N)")
    return int(found["nodes"]), int(found["per_node"]) if "per_node" in found else None


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


def _named_logs(run_dir, ranks: list) -> str:
    return ", ".join(str(log_path(run_dir, r)) for r in ranks)


def _refuse_unforwarded(env: dict) -> None:
    """A rank whose environment is not what the launch set for it (a template's wrapper, module system or
    site script between bitdet and the rank dropped or changed it) is refused before anything reads it,
    naming each variable: the launching node validated these values and records them for every rank.
    PYTHONHASHSEED is judged by what this interpreter really hashes with."""
    from megatron_bitdet.enforce.env import hash_seed_in_effect

    wrong = []
    for name, want in env.items():
        got = os.environ.get(name)
        if name == "PYTHONHASHSEED" and got == want and want.isdigit() and hash_seed_in_effect() != str(int(want)):
            got = "(set, but this interpreter hashes str randomly: python -E / -I?)"
        if got != want:
            wrong.append(f"{name}={want!r} " + ("missing" if got is None else f"but {got!r} here"))
    if wrong:
        raise BitdetInputError(
            f"on host {socket.gethostname()}: refused: this rank did not start with the environment the launch set "
            f"for every rank: {'; '.join(wrong)}. bitdet puts it on the command line ({_ENV_PROGRAM} K=V ... "
            "before torchrun, or before the rank program under srun); something between that and this rank (a "
            "wrapper script, a module system, a site's torchrun) dropped or changed it: let it through unchanged")


def _tee_output(path: Path) -> None:
    """A launcher's rank: this process's stdout and stderr (C++ included) go to ``path`` and on to the
    launcher's console, through ``tee``, which outlives a crash of the rank. The ``logs`` folder must
    already be there: the launching node made it, so a node that does not see it does not share the run
    directory."""
    if not path.parent.is_dir():
        raise BitdetInputError(
            f"on host {socket.gethostname()}: refused: {path.parent} does not exist here, although the launching "
            "node made it before starting the ranks: the run directory must be on a filesystem every node mounts "
            "at the same path (each rank writes its log, fingerprints and checkpoints there)")
    read, write = os.pipe()
    subprocess.Popen(["tee", "-a", str(path)], stdin=read, stdout=1, stderr=subprocess.DEVNULL)
    os.close(read)
    os.dup2(write, 1)
    os.dup2(write, 2)
    os.close(write)


def _child_main(argv: list[str]) -> int:
    worker_path, args_json, backend, env_json, run_dir = argv
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # srun started this rank (Launcher.run)
        os.environ.update(RANK=os.environ["SLURM_PROCID"], LOCAL_RANK=os.environ["SLURM_LOCALID"])
    try:
        if run_dir:
            _tee_output(log_path(run_dir, int(os.environ["RANK"])))
        _refuse_unforwarded(json.loads(env_json))
        return run_rank(worker_path, json.loads(args_json), backend or None, fresh_interpreter=True)
    except BitdetError as exc:
        print(f"rank {os.environ.get('RANK')}: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
