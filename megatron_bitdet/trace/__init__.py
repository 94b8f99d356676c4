"""Per-rank semantic / module / op traces (see tracer.Tracer) and their on-disk format."""
from megatron_bitdet.trace.format import event_id, open_trace, trace_path
from megatron_bitdet.trace.tracer import TraceConfig, Tracer

__all__ = ["Tracer", "TraceConfig", "open_trace", "trace_path", "event_id"]
