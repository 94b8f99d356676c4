"""Run megatron-core on a CPU-only torch.

megatron-core assumes CUDA in a handful of places (listed seam by seam in ``seams.py``). This
module fills exactly those, only when CUDA is unavailable, and refuses to run against a
megatron-core version it was not written for: a silent half-working backend would put wrong
numbers into every bitwise claim. On a GPU ``install()`` does nothing.
"""
from megatron_bitdet.compat.cpu_backend.seams import eager_jit_fuser, install, installed

__all__ = ["eager_jit_fuser", "install", "installed"]
