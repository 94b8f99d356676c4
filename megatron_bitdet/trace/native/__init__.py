"""The native tracer (``op_trace.cpp``): op-level tracing without a Python frame per op, and the
module hooks of levels module and op in C++ (``hooks._NativeModuleHooks``).

Built on first use by torch's extension builder (g++ and ninja; about a minute) and cached under
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), one build per source, Python and
torch version; ``python -m megatron_bitdet.trace.native`` builds it ahead (``make install`` does).
Where it cannot be built, ``load()`` returns None and ``why()`` says why: op tracing then uses the
Python dispatch mode. ``BITDET_OP_TRACER=python`` chooses the Python mode on purpose.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("op_trace.cpp")
ENV = "BITDET_OP_TRACER"
_loaded: dict = {}


def _ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` wheel's binary counts too."""
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass


def _build():
    import torch
    import xxhash._xxhash
    from torch.utils import cpp_extension

    from megatron_bitdet.fingerprint.tensor import dtype_name

    _ninja_on_path()
    tag = hashlib.sha256(f"{SOURCE.read_bytes()!r}{torch.__version__}{sys.version}".encode()).hexdigest()[:12]
    name = "bitdet_op_trace_" + re.sub(r"\W", "_", torch.__version__) + "_" + tag
    mod = cpp_extension.load(name, [str(SOURCE)], extra_cflags=["-O2"], verbose=False)
    dtypes = [(d, dtype_name(d)) for d in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}]
    mod.init(xxhash._xxhash.__file__, dtypes)
    return mod


def load():
    """The built extension, or None when this machine cannot build it (``why()`` says why)."""
    if os.environ.get(ENV) == "python":
        return None
    if "mod" not in _loaded:
        try:
            _loaded["mod"] = _build()
        except Exception as exc:  # no compiler, no ninja, headers missing: fall back, say why once
            lines = str(exc).strip().splitlines()
            said = next((x for x in lines if "error" in x.lower() and x is not lines[0]), lines[0] if lines else "")
            _loaded["mod"], _loaded["why"] = None, f"native op tracer not built ({type(exc).__name__}: {said[:300]})"
            warnings.warn(_loaded["why"] + "; op tracing uses the Python dispatch mode", stacklevel=2)
    return _loaded["mod"]


def why() -> str | None:
    """Why ``load()`` returns None (None when it does not)."""
    return f"{ENV}=python" if os.environ.get(ENV) == "python" else _loaded.get("why")
