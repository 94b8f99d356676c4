"""Test-only: record every host transfer and host sync a training rank makes, with who made it and
whether a training step was in flight (importable via PYTHONPATH=tests).

Two observers, neither changing what runs. On this CPU-only torch every tensor is on the host, so a
read that would copy device memory to the host on a GPU is recorded by what it is, not by where its
bytes go: a ``TorchFunctionMode`` sees the tensor methods that hand a tensor's bytes to Python
(``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``__array__``, ``.to(<cpu>)``: on CPU tensors
``.tolist()`` and ``.cpu()`` reach no aten op at all, so only this mode sees them), and a
``TorchDispatchMode`` sees the aten ops that block the host on a device: ``_local_scalar_dense``
(``.item()``, ``bool(t)``, ``int(t)``), ops whose output size depends on the data (``nonzero``,
``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``, indexing or
assignment through a boolean mask), ``equal`` / ``allclose`` (a Python bool), and device-to-host
copies. ``torch.cuda.synchronize`` and stream / event waits are not seen: on this CPU-only torch an
unguarded call raises (not compiled with CUDA) and fails the run.

Each event is written at once to ``$BITDET_RECORD_DIR/rank_XXXXX.jsonl`` with the innermost caller
outside torch (``bitdet``: that caller is bitdet's code), the step frame it ran under, if any
(megatron's ``train_step`` (Megatron-LM), bitdet's loop ``train_step``, or the per-step digests'
launches ``StepDigests.grads`` / ``.state``), and the storage it read. ``state_storages`` writes
which storages hold the training state (params, grads, main params, module buffers), which a report
of a read names."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)
STEP_FRAMES = {("megatron/training/training.py", "train_step"), ("megatron_bitdet/train/loop.py", "train_step"),
               ("megatron_bitdet/train/step_fingerprints.py", "grads"),
               ("megatron_bitdet/train/step_fingerprints.py", "state")}
_HOST_METHODS = {"item", "tolist", "numpy", "cpu", "__array__"}
# aten ops that make the host wait for a device: a scalar read, an output sized by the data, a bool result
_BLOCKING = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
             "unique_consecutive", "equal", "allclose", "bincount", "histc"}


def _masked(indices) -> bool:
    """Indexing through a boolean mask (its nonzero elements: a data-sized result)."""
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


class Recorder:
    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")
        self.busy = False

    def event(self, what: str, tensor=None) -> None:
        if self.busy:
            return
        self.busy = True
        try:
            frame, caller, step = sys._getframe(2), None, None
            while frame is not None:
                f = frame.f_code.co_filename
                if caller is None and not f.startswith(_TORCH) and os.path.abspath(f) != _HERE:
                    caller = f"{f}:{frame.f_lineno}:{frame.f_code.co_name}"
                if step is None and any(f.endswith(s) and frame.f_code.co_name == n for s, n in STEP_FRAMES):
                    step = f"{f}:{frame.f_code.co_name}"
                frame = frame.f_back
            ptr = tensor.untyped_storage().data_ptr() if isinstance(tensor, torch.Tensor) else None
            self._f.write(json.dumps({"op": what, "caller": caller, "in_step": step, "storage": ptr,
                                      "bitdet": caller is not None and "/megatron_bitdet/" in caller}) + "\n")
            self._f.flush()
        finally:
            self.busy = False


class _Functions(TorchFunctionMode):
    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_METHODS or (name == "to" and (any(isinstance(a, (str, torch.device)) and _is_cpu(a)
                                                           for a in args[1:]) or _is_cpu(kwargs.get("device")))):
            self.recorder.event(f"Tensor.{name}", args[0] if args else None)
        return func(*args, **kwargs)


class _Dispatch(TorchDispatchMode):
    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _BLOCKING or (name in ("index", "index_put_", "index_put") and _masked(args[1])) or (
                name == "repeat_interleave" and func is not torch.ops.aten.repeat_interleave.self_int
                and kwargs.get("output_size") is None):  # repeats in a tensor: their sum sizes the output
            self.recorder.event(f"aten.{name}", args[0] if isinstance(args[0], torch.Tensor) else None)
        elif name == "_to_copy" and _is_cpu(kwargs.get("device")) and args[0].device.type != "cpu":
            self.recorder.event("aten._to_copy(device->host)", args[0])
        elif name == "copy_" and args[0].device.type == "cpu" and args[1].device.type != "cpu":
            self.recorder.event("aten.copy_(device->host)", args[1])
        return func(*args, **kwargs)


def install(rank: int) -> None:
    """Start recording for this rank (the modes stay entered for the life of the process)."""
    recorder = Recorder(Path(os.environ["BITDET_RECORD_DIR"]) / f"rank_{rank:05d}.jsonl")
    _Functions(recorder).__enter__()
    _Dispatch(recorder).__enter__()


def state_storages(ddp_modules) -> None:
    """Write this rank's training-state storages (DDP buffers, params, main params, module buffers)."""
    tensors = [t for m in ddp_modules for b in (*m.buffers, *m.expert_parallel_buffers)
               for t in (b.param_data, b.grad_data) if t is not None]
    for m in ddp_modules:
        for p in m.module.parameters():
            tensors += [p, *[t for t in (getattr(p, "main_param", None), getattr(p, "main_grad", None)) if t is not None]]
        tensors += list(m.module.buffers())
    path = Path(os.environ["BITDET_RECORD_DIR"]) / f"state_{torch.distributed.get_rank():05d}.json"
    path.write_text(json.dumps(sorted({t.untyped_storage().data_ptr() for t in tensors})))


def read(record_dir) -> list[dict]:
    """Every rank's events, each with ``state``: whether the storage it read holds training state."""
    state = {p for f in Path(record_dir).glob("state_*.json") for p in json.loads(f.read_text())}
    assert state, "no state storages were written"
    events = [json.loads(line) for f in sorted(Path(record_dir).glob("rank_*.jsonl"))
              for line in f.read_text().splitlines()]
    return [{**e, "state": e["storage"] in state} for e in events]
