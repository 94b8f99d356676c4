"""The tracing flags (``--trace LEVEL --trace-steps A-B --trace-ranks LIST --trace-hash H --trace-capture
R:EVENT``) of every launch line that trains — ``bitdet train``'s and a Megatron-LM script's under the
entry point: one parser (flags -> ``TraceConfig``, validated before any rank starts) and its inverse
(``TraceConfig`` -> flags, for a re-launch). Imports no torch: the Megatron-LM entry point adds these flags
to its pre-parser before the canonical environment is in place."""
from __future__ import annotations

from megatron_bitdet.errors import BitdetInputError


def parse_ranks(text: str, flag: str = "--ranks") -> list[int]:
    """'0,2,4-7' -> [0, 2, 4, 5, 6, 7]; BitdetInputError (naming ``flag``) on anything else."""
    ranks: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, _, hi = part.partition("-")
            ranks.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise BitdetInputError(f"{flag}: expected e.g. '0,2,4-7', got {text!r}") from None
    if not ranks:
        raise BitdetInputError(f"{flag}: nothing in {text!r}")
    return ranks


def add_trace_args(p) -> None:
    """The tracing flags on ``p`` (an argparse parser)."""
    g = p.add_argument_group("tracing", "per-rank traces for `bitdet localize` (off: nothing is installed)")
    g.add_argument("--trace", metavar="LEVEL",
                   help="semantic (gradient reduction, optimizer, collectives), module (+ every module's "
                        "forward/backward) or op (+ every dispatcher op)")
    g.add_argument("--trace-steps", metavar="A-B", help="inclusive step window (default: every step)")
    g.add_argument("--trace-ranks", metavar="LIST", help="ranks to trace, e.g. 0,2-3 (default: all)")
    g.add_argument("--trace-hash", default="fast", metavar="HASH", help="tensor digest: fast (default), exact, xor")
    g.add_argument("--trace-capture", metavar="RANK:EVENT_ID",
                   help="op level: save that op occurrence's inputs and outputs on that rank to "
                        "RUN_DIR/captures/ (the kernel rung's capture; `bitdet replay-op` replays it)")


def trace_settings(args):
    """The run's ``TraceConfig`` from the tracing flags (None: tracing off); BitdetInputError on bad ones."""
    capture = getattr(args, "trace_capture", None)
    if not args.trace:
        if args.trace_steps or args.trace_ranks or capture:
            raise BitdetInputError("--trace-steps / --trace-ranks / --trace-capture need --trace LEVEL")
        return None
    steps = [1, 1 << 62]
    if args.trace_steps:
        lo, sep, hi = args.trace_steps.partition("-")
        try:
            steps = [int(lo), int(hi if sep else lo)]
        except ValueError:
            raise BitdetInputError(f"--trace-steps: expected A-B, e.g. 3-4, got {args.trace_steps!r}") from None
        if not 1 <= steps[0] <= steps[1]:
            raise BitdetInputError(f"--trace-steps {args.trace_steps}: need 1 <= A <= B")
    ranks = parse_ranks(args.trace_ranks, "--trace-ranks") if args.trace_ranks else None
    if capture:
        rank, sep, event = capture.partition(":")
        if not sep or not rank.strip().isdigit() or not event:
            raise BitdetInputError(f"--trace-capture: expected RANK:EVENT_ID, e.g. 0:1/forward/decoder.layers.2."
                                   f"mlp.linear_fc2/aten.mm.default#0, got {capture!r}")
        if args.trace != "op":
            raise BitdetInputError("--trace-capture captures an op occurrence: it needs --trace op")
        capture = {"rank": int(rank), "event_id": event}
    from megatron_bitdet.trace.tracer import TraceConfig

    return TraceConfig(args.trace, tuple(steps), frozenset(ranks) if ranks else None, args.trace_hash, capture)


def trace_flags(config) -> list[str]:
    """The flags ``trace_settings`` reads back as ``config`` (none for None)."""
    if config is None:
        return []
    out = ["--trace", config.level, "--trace-steps", f"{config.steps[0]}-{config.steps[1]}",
           "--trace-hash", config.hash]
    if config.ranks is not None:
        out += ["--trace-ranks", ",".join(map(str, sorted(config.ranks)))]
    if config.capture:
        extra = set(config.capture) - {"rank", "event_id"}
        if extra:
            raise BitdetInputError(f"a capture with {sorted(extra)} has no launch-line flag")
        out += ["--trace-capture", f"{config.capture['rank']}:{config.capture['event_id']}"]
    return out
