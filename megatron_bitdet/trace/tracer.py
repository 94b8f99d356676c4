"""The per-rank Tracer: windows, phases, scopes, run-independent event ids, buffered JSONL records.

Nothing is installed outside a traced step: hooks, the dispatch mode and the torch.distributed
wrappers are put in place when a step inside the window begins and removed when it ends.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.trace import collectives, hooks, native, ops
from megatron_bitdet.trace.capture import DEFAULT_MAX_BYTES, OpCapture
from megatron_bitdet.trace.digest import HASHES, digest, fast, release_spans, resolve, trace_tensors
from megatron_bitdet.trace.format import (LEVELS, TraceWriter, event_id, json_str, op_line, record_line,
                                          trace_path)

_FLUSH_EVERY = 4096
_NO_EXTRA: dict = {}


@dataclass(frozen=True)
class TraceConfig:
    level: str = "semantic"
    steps: tuple[int, int] = (1, 1 << 62)   # inclusive window
    ranks: frozenset[int] | None = None     # None: every rank
    hash: str = "fast"
    capture: dict | None = None             # {"rank", "event_id", "max_bytes"?}: the kernel rung's capture

    def __post_init__(self):
        if self.level not in LEVELS:
            raise BitdetInputError(f"trace level {self.level!r}: expected one of {', '.join(LEVELS)}")
        if self.hash not in HASHES:
            raise BitdetInputError(f"trace hash {self.hash!r}: expected one of {', '.join(HASHES)}")

    def to_json(self) -> dict:
        """The form the ranks receive and the manifest records."""
        d = {"level": self.level, "steps": list(self.steps),
             "ranks": None if self.ranks is None else sorted(self.ranks), "hash": self.hash}
        return {**d, "capture": self.capture} if self.capture else d

    @classmethod
    def from_json(cls, d: dict) -> "TraceConfig":
        ranks = d.get("ranks")
        return cls(d["level"], tuple(d["steps"]), None if ranks is None else frozenset(ranks), d.get("hash", "fast"),
                   d.get("capture"))


class Tracer:
    """Write this rank's trace under RUN_DIR/traces/. No collectives, no cross-rank ordering."""

    def __init__(self, run_dir, rank: int, world_size: int, level: str = "semantic",
                 steps: tuple[int, int] = (1, 1 << 62), ranks=None, hash: str = "fast",
                 manifest_digest: str | None = None, capture: dict | None = None):
        """``capture``: {"rank", "event_id", "max_bytes"?} arms an OpCapture of that op occurrence (op level)."""
        self.config = TraceConfig(level, tuple(steps), frozenset(ranks) if ranks is not None else None, hash)
        self.rank = rank
        self.enabled = ranks is None or rank in self.config.ranks
        self.active = False
        self.modules: list[tuple[str, torch.nn.Module]] = []
        self._phase = ["forward"]
        self._scope: list[str] = []
        self.bwd_scope = ""                 # the Python hooks' backward scope
        self._counts: dict = {}
        self._buf: list[dict] = []
        self._step = 0
        self._quiet = 0                     # >0 while the tracer itself runs torch ops (not traced)
        self._native = None                 # the native tracer while it runs a step (module and op levels)
        self.collective_wrappers = None     # collectives.Wrappers, made at the first traced step
        self.inflight: dict[int, str] = {}  # data_ptr -> async collective whose output is not waited yet
        self.uninit: dict[int, None] = {}   # data_ptr of aten.empty* outputs not yet written
        # which tracer runs module hooks and ops ("native": C++ hooks and dispatcher fallback, or
        # "python"); at level op it is in the header: the op streams differ in a few records, so the
        # analysis refuses to align traces of different ones (module records are the same)
        impl = ops.implementation(self.config) if self.enabled else None
        self.op_tracer = impl if level == "op" else None
        self.tracks_memory = level == "op"  # uninitialized and in-flight buffers: only op records read them
        mod = native.load() if impl == "native" else None
        self._native_mod = mod if level in ("module", "op") else None  # runs the step's hooks (and ops)
        self._native_digests = mod.digests if mod is not None else None  # Tracer.fps at every level
        self._writer = None
        self.capture = None
        if capture and capture.get("rank") == rank and self.enabled:
            if level != "op":
                raise BitdetInputError("capturing an op occurrence needs trace level 'op'")
            self.capture = OpCapture(run_dir, rank, capture["event_id"], capture.get("max_bytes", DEFAULT_MAX_BYTES),
                                     context={"manifest_digest": manifest_digest})
        if self.enabled:
            self._writer = TraceWriter(trace_path(run_dir, rank), {
                "rank": rank, "world_size": world_size, "level": level, "steps": list(self.config.steps),
                "ranks": sorted(self.config.ranks) if self.config.ranks is not None else None,
                "hash": hash, "manifest_digest": manifest_digest,
                **({"op_tracer": self.op_tracer} if self.op_tracer else {}),
            })

    # -- setup -------------------------------------------------------------------------------
    def attach(self, model_chunks) -> None:
        """Remember the model chunks whose modules get scope names (hooks come only with a traced step)."""
        chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        multi = len(chunks) > 1
        for i, chunk in enumerate(chunks):
            for name, mod in chunk.named_modules():
                full = ".".join(p for p in (f"chunk{i}" if multi else "", name) if p) or "model"
                self.modules.append((full, mod))

    def in_window(self, step: int) -> bool:
        lo, hi = self.config.steps
        return self.enabled and lo <= step <= hi

    @contextmanager
    def step(self, step: int):
        """Trace this step if it lies in the window; otherwise run it untouched."""
        if not self.in_window(step):
            yield self
            return
        self._step, self._counts, self.active = step, {}, True
        with ExitStack() as stack:
            stack.enter_context(collectives.installed(self))
            if self._native_mod is not None:
                stack.enter_context(self._native_bound())
            if self.config.level in ("module", "op"):
                stack.enter_context(hooks.installed(self, record=self.config.level == "module"))
            if self.config.level == "op":
                stack.enter_context(ops.installed(self))
            try:
                yield self
            finally:
                self.active = False
                release_spans()
        self.flush()

    @contextmanager
    def phase(self, name: str):
        self._phase.append(name)
        self._tell_native("set_phase", name)
        try:
            yield
        finally:
            self._phase.pop()
            self._tell_native("set_phase", self._phase[-1])

    # -- the state the native op tracer mirrors -------------------------------------------------
    @property
    def quiet(self) -> int:
        return self._quiet

    @quiet.setter
    def quiet(self, n: int) -> None:
        self._quiet = n
        if self._native is not None and self.op_tracer is not None:  # only its op fallback goes quiet
            self._native.set_quiet(n > 0)

    def _tell_native(self, setter: str, value: str) -> None:
        if self._native is not None:
            getattr(self._native, setter)(value, json_str(value))

    @contextmanager
    def _native_bound(self):
        """The native tracer runs this step: its hooks keep the scopes, its fallback (level op) traces
        the ops, its records join the buffer in order; it gets the phase now and at each change."""
        mod = self._native = self._native_mod
        mod.start(self._step, self.config.level == "op")
        self._tell_native("set_phase", self._phase[-1])
        mod.set_quiet(self._quiet > 0)
        try:
            yield
        finally:
            self._native = None
            mod.stop()
            self._buf.extend(mod.take())

    def mark_uninit(self, ptr: int) -> None:
        """Memory whose contents mean nothing until an op writes it (op level's read-artifact check)."""
        if not self.tracks_memory:
            return
        if self._native is not None:
            self._native.ptrs_add("uninit", ptr)
        else:
            self.uninit[ptr] = None

    def in_flight(self, ptr: int, name: str) -> None:
        """An async collective's output buffer, not yet waited on."""
        if self._native is not None:
            self._native.ptrs_add("inflight", ptr)
        else:
            self.inflight[ptr] = name

    def landed(self, ptr: int) -> None:
        """The collective writing ``ptr`` completed: its contents are now real and written."""
        if self._native is not None:
            self._native.ptrs_discard("inflight", ptr)
            self._native.ptrs_discard("uninit", ptr)
        else:
            self.inflight.pop(ptr, None)
            self.uninit.pop(ptr, None)

    # -- scope (maintained by the Python hooks; the native tracer keeps its own) ------------------
    def push_scope(self, name: str) -> None:
        self._scope.append(name)

    def pop_scope(self) -> None:
        if self._scope:
            self._scope.pop()

    def current(self) -> tuple[str, str]:
        """(phase, scope) now; autograd's engine thread means backward, scoped by the tensor hooks."""
        if self._native is not None:
            return self._native.current()
        phase = self._phase[-1]
        if torch._C._current_autograd_node() is not None:
            return ("backward" if phase == "forward" else phase), self.bwd_scope
        return phase, self._scope[-1] if self._scope else ""

    # -- records --------------------------------------------------------------------------------
    def next_id(self, name: str) -> str:
        """The event id the next record named ``name`` would get here (for arming a capture)."""
        ph, sc = self.current()
        return event_id({"step": self._step, "phase": ph, "scope": sc, "name": name,
                         "n": self._counts.get((ph, sc, name), 0)})

    def fps(self, tensors) -> list:
        if self._native_digests is not None:  # CPU, hash fast: the same digests, in C++ (no torch op traced)
            return self._native_digests(tensors)
        self.quiet += 1
        try:
            mode = self.config.hash
            if mode == "fast":  # the default, called for every module input and output: one call less each
                return [fast(t) for t in tensors]
            return [digest(t, mode) for t in tensors]
        finally:
            self.quiet -= 1

    def record(self, kind: str, name: str, ins: list, outs: list, phase: str | None = None,
               scope: str | None = None, fields: str = "", **extra) -> None:
        """``fields``: the extra fields already as ``format.extra_json`` (instead of ``extra``).

        Buffered as its finished line when every digest is a string: the buffer then holds no
        containers, which would otherwise trigger ~20 young and ~2 middle garbage collections in an
        op-traced step. Pending device digests keep the tuple until the flush resolves them. The
        native tracer's records so far go first (one order for both)."""
        if phase and scope is not None:  # given both (backward and collective records): no lookup
            ph, sc = phase, scope
        else:
            ph, sc = self.current()
            ph, sc = phase or ph, sc if scope is None else scope
        key = (ph, sc, name)
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        rec = (self._step, ph, sc, name, n, kind, ins, outs, fields or extra)
        buf = self._buf
        if self._native is not None:
            buf.extend(self._native.take())
        try:
            buf.append(record_line(*rec))
        except TypeError:
            buf.append(rec)
        if len(buf) >= _FLUSH_EVERY:
            self.flush()

    def record_op(self, name: str, ins: list, outs: list, flags: list | None) -> None:
        """``record("op", ...)`` for the dispatch mode: the same record, built as its line at once."""
        ph = self._phase[-1]
        if torch._C._current_autograd_node() is not None:
            ph, sc = ("backward" if ph == "forward" else ph), self.bwd_scope
        else:
            sc = self._scope[-1] if self._scope else ""
        key = (ph, sc, name)
        counts = self._counts
        n = counts.get(key, 0)
        counts[key] = n + 1
        buf = self._buf
        try:
            buf.append(op_line(self._step, ph, sc, name, n, ins, outs, flags))
        except TypeError:  # a digest pending on a device: the flush resolves it
            buf.append((self._step, ph, sc, name, n, "op", ins, outs, {"flags": flags} if flags else _NO_EXTRA))
        if len(buf) >= _FLUSH_EVERY:
            self.flush()

    def event(self, name: str, tensors=None, *, inputs=None, phase: str | None = None,
              scope: str | None = None, **extra) -> None:
        """A named semantic event (gradient reduction, optimizer step, recomputation, pipeline p2p...).

        `tensors` are the values observed at this point (outputs); `inputs` those it was computed from.
        """
        if not self.active:
            return
        self.record("event", name, self.fps(trace_tensors(inputs)), self.fps(trace_tensors(tensors)),
                    phase=phase, scope=scope, **extra)

    def flush(self) -> None:
        if not self._buf or self._writer is None:
            return
        buf, self._buf = self._buf, []
        pending = [r for r in buf if type(r) is tuple]
        if pending:
            resolve([r[6] for r in pending] + [r[7] for r in pending])
        self._writer.write_lines([r if type(r) is str else record_line(*r) for r in buf])

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
