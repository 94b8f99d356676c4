"""Per-rank semantic / module / op traces (see tracer.Tracer) and their on-disk format.

The names are resolved on first use, so ``trace.options`` (the tracing flags) imports without torch:
the Megatron-LM entry point parses a launch line before the canonical environment is in place."""
import importlib

_HOMES = {"Tracer": "tracer", "TraceConfig": "tracer", "open_trace": "format", "trace_path": "format",
          "event_id": "format"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
