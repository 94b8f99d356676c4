"""On-disk trace format: one append-only JSONL per rank, header first, whole lines only.

Records carry no timestamps and no global sequence numbers, so two identical runs write
byte-identical lines; the analysis compares raw lines and parses only around a mismatch.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.rundir import trace_dir, trace_path  # noqa: F401  (rundir owns the paths)

FORMAT = "bitdet-trace"
VERSION = 1
LEVELS = ("semantic", "module", "op")


def event_id(rec: dict) -> str:
    """The run-independent id: step / phase / module scope / name / occurrence within (scope, name)."""
    return f"{rec['step']}/{rec['phase']}/{rec['scope']}/{rec['name']}#{rec['n']}"


_JSON_STRINGS: dict[str, str] = {}
_HEADS: dict[tuple, tuple[str, str]] = {}


def json_str(s: str) -> str:
    """``json.dumps(s)``, cached: scopes and names repeat in every record."""
    v = _JSON_STRINGS.get(s)
    if v is None:
        if len(_JSON_STRINGS) > 65536:
            _JSON_STRINGS.clear()
        v = _JSON_STRINGS[s] = json.dumps(s)
    return v


def _digest_list(xs: list) -> str:
    """``json.dumps(xs)`` of a list of the tracer's digest strings ("dtype[shape]:...", "...:uninit"):
    they are ASCII made of names, digits, brackets, commas and colons, so no character needs
    escaping. A digest still pending on a device (a tuple, not a string) raises TypeError."""
    return '["' + '","'.join(xs) + '"]' if xs else "[]"


def _line(step: int, phase: str, scope: str, name: str, n: int, kind: str, ins: list, outs: list) -> str:
    """A record's line up to its extra fields and closing brace, from the cached head of (phase, scope,
    name, kind)."""
    key = (phase, scope, name, kind)
    head = _HEADS.get(key)
    if head is None:
        if len(_HEADS) > 65536:
            _HEADS.clear()
        head = _HEADS[key] = (f',"phase":{json_str(phase)},"scope":{json_str(scope)},"name":{json_str(name)},'
                              f'"n":', f',"k":{json_str(kind)},"in":')
    return f'{{"step":{step}{head[0]}{n}{head[1]}{_digest_list(ins)},"out":{_digest_list(outs)}'


def extra_json(extra: dict) -> str:
    """A record's extra fields as the JSON its line holds after "out" (without braces): what a
    caller repeating the same fields renders once and passes to ``record_line`` instead of the dict."""
    return json.dumps(extra, separators=(",", ":"))[1:-1]


def record_line(step: int, phase: str, scope: str, name: str, n: int, kind: str, ins: list, outs: list,
                extra: dict | str) -> str:
    """One record as its JSONL line: exactly ``json.dumps`` of the record dict (compact separators),
    built from cached pieces because an op-level trace writes thousands of lines a step. ``extra``:
    the extra fields, or their ``extra_json``."""
    line = _line(step, phase, scope, name, n, kind, ins, outs)
    if extra:
        line += "," + (extra if type(extra) is str else extra_json(extra))
    return line + "}"


def op_line(step: int, phase: str, scope: str, name: str, n: int, ins: list, outs: list, flags) -> str:
    """``record_line`` of an op record: kind "op", extra ``{"flags": flags}`` when there are flags."""
    line = _line(step, phase, scope, name, n, "op", ins, outs)
    return line + (',"flags":' + _digest_list(flags) + "}" if flags else "}")


class TraceWriter:
    """Buffered writer that only ever appends complete, flushed lines."""

    def __init__(self, path: Path, header: dict):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "w", encoding="utf-8")
        self._f.write(json.dumps({"format": FORMAT, "v": VERSION, **header}, separators=(",", ":")) + "\n")
        self._f.flush()

    def write_lines(self, lines: list[str]) -> None:
        if lines:
            self._f.write("\n".join(lines) + "\n")
            self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()


@dataclass
class TraceFile:
    """An opened trace: validated header plus a line iterator that yields (line_no, raw bytes)."""

    path: Path
    header: dict

    def lines(self, offset: int | None = None, line_no: int = 1):
        """Raw record lines after the header (or from byte `offset`, whose line is `line_no` + 1);
        a truncated last line is dropped and flagged in `truncated`."""
        self.truncated = False
        with open(self.path, "rb") as f:
            if offset is None:
                f.readline()
            else:
                f.seek(offset)
            for raw in f:
                line_no += 1
                if not raw.endswith(b"\n"):
                    self.truncated = True  # crash while writing the final record
                    return
                yield line_no, raw


def parse_record(path: Path, line_no: int, raw: bytes) -> dict:
    """A record as the tracer writes it: a corrupt one is refused, never read as a benign difference."""
    try:
        rec = json.loads(raw.decode("utf-8"))  # strict: json.loads(bytes) would let lone surrogates through
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and over-long integers included
        raise BitdetInputError(f"{path}:{line_no}: not a trace record ({str(exc)[:200]})") from None
    problem = _record_problem(rec)
    if problem:
        raise BitdetInputError(f"{path}:{line_no}: not a trace record ({problem})")
    return rec


def _record_problem(rec) -> str:
    if not isinstance(rec, dict):
        return "not a JSON object"
    if type(rec.get("step")) is not int or rec["step"] < 1 or type(rec.get("n")) is not int or rec["n"] < 0:
        return "'step' and 'n' must be integers"
    bad = [k for k in ("phase", "scope", "name") if not isinstance(rec.get(k), str)]
    if bad:
        return f"{bad[0]!r} must be a string"
    for key in ("in", "out", "flags"):
        xs = rec.get(key, [])
        if not isinstance(xs, list) or not all(isinstance(x, str) and (key == "flags" or ":" in x) for x in xs):
            return f"{key!r} must be a list of {'flag names' if key == 'flags' else 'digests'}"
    return ""


def open_trace(path: Path) -> TraceFile:
    """Open and validate a trace file's header; BitdetInputError names the file on any problem."""
    path = Path(path)
    if not path.is_file():
        raise BitdetInputError(f"{path}: trace file missing")
    with open(path, "rb") as f:
        first = f.readline()
    try:
        header = json.loads(first.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and over-long integers included
        raise BitdetInputError(f"{path}:1: not a bitdet trace header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise BitdetInputError(f"{path}:1: foreign file (no '{FORMAT}' header)")
    if header.get("v") != VERSION:
        raise BitdetInputError(f"{path}:1: trace format version {header.get('v')!r}, expected {VERSION}")
    for key in ("rank", "world_size", "level"):
        if key not in header:
            raise BitdetInputError(f"{path}:1: header lacks {key!r}")
    ranks = header.get("ranks")
    if (type(header["rank"]) is not int or type(header["world_size"]) is not int or header["world_size"] < 1
            or not (ranks is None or isinstance(ranks, list) and all(type(r) is int for r in ranks))):
        raise BitdetInputError(f"{path}:1: header's rank, world_size or ranks is not an integer (list)")
    return TraceFile(path, header)
