"""``python -m megatron_bitdet.trace.native``: build the native op tracer now (``make install`` does)."""
from megatron_bitdet.trace.native import load, why

print("native op tracer: " + ("built" if load() is not None else str(why())))
