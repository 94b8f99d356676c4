"""The CPU backend's install gate, version guard, literal rewriting and RNG tracker, on real torch/megatron."""
from __future__ import annotations

import pytest
import torch

from megatron_bitdet.compat import cpu_backend
from megatron_bitdet.compat.cpu_backend import seams
from megatron_bitdet.errors import BitdetError

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend is inactive with CUDA")

cpu_backend.install()


def test_install_fills_every_seam_once():
    # tests/conftest.py made this process's jit_fuser eager before megatron-core's import, as a rank's start does
    assert cpu_backend.installed() == ["eager_jit_fuser", *(s.__name__ for s in seams.SEAMS)]
    current_device = torch.cuda.current_device
    assert cpu_backend.install() == cpu_backend.installed()
    assert torch.cuda.current_device is current_device  # a second install re-ran nothing
    assert torch.cuda.current_device() == torch.device("cpu")


def test_install_does_nothing_when_cuda_is_present(monkeypatch):
    """The gate itself is the subject: CUDA is reported present, the process otherwise unpatched."""
    monkeypatch.setattr(seams, "_INSTALLED", [])
    monkeypatch.setattr(seams, "_EAGER", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    assert cpu_backend.install() == []
    assert torch.cuda.current_device is current_device


@pytest.mark.parametrize("found", ["0.20.0", "0.16.0"])
def test_unsupported_megatron_core_is_refused(monkeypatch, found):
    from megatron_bitdet.compat import versions

    monkeypatch.setattr(seams, "_INSTALLED", [])
    monkeypatch.setattr(seams, "_EAGER", [])
    monkeypatch.setattr(versions, "version", lambda dist: found if dist == "megatron-core" else "?")
    with pytest.raises(BitdetError, match=rf"megatron-core {found} is installed; megatron-bitdet supports "
                                          r"megatron-core >=0\.16\.1,<0\.20"):
        cpu_backend.install()
    assert seams.installed() == []


# --------------------------------------------------------------------------- literal rewriting


def no_cuda_literal(n):
    return torch.zeros(n)


def cuda_literal(n):
    return torch.zeros(n, device='cuda')


class Base:
    def make(self, n):
        return torch.ones(n)


class Child(Base):
    def make(self, n):
        return super().make(n).to(device='cuda')


def test_target_without_cuda_literal_is_refused():
    with pytest.raises(BitdetError, match="test_cpu_backend:no_cuda_literal has no CUDA literal any more"):
        seams._cuda_literals_to_cpu("test_cpu_backend:no_cuda_literal")
    for gone in ("test_cpu_backend:moved_away", "test_cpu_backend:Child.moved_away"):  # e.g. 0.19's training utils
        with pytest.raises(BitdetError, match=f"{gone} is gone; megatron-core changed under the seam"):
            seams._cuda_literals_to_cpu(gone)


def test_cuda_literals_are_pointed_at_the_cpu():
    """A function and a method using zero-argument super(): both rewritten, both still work."""
    with pytest.raises((AssertionError, RuntimeError)):  # unpatched: CUDA is not available here
        cuda_literal(2)
    seams._cuda_literals_to_cpu("test_cpu_backend:cuda_literal")
    seams._cuda_literals_to_cpu("test_cpu_backend:Child.make")
    assert globals()["cuda_literal"](2).device == torch.device("cpu")
    assert torch.equal(Child().make(3), torch.ones(3))


# --------------------------------------------------------------------------- RNG tracker


def _state_bytes() -> bytes:
    return torch.get_rng_state().numpy().tobytes()


def test_tracker_fork_advances_the_named_stream_and_restores_the_outer_one():
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker()  # the CPU tracker once the seam is in
    assert type(tracker).__name__ == "CpuRNGStatesTracker"
    tracker.add("model-parallel-rng", 123)
    named = torch.Generator().manual_seed(123)
    expected_named = torch.rand(8, generator=named)
    torch.manual_seed(7)
    outer_before = _state_bytes()
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(4)
    assert _state_bytes() == outer_before  # the outer stream did not move
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(4)  # continues where the first fork stopped
    assert torch.cat([first, second]).numpy().tobytes() == expected_named.numpy().tobytes()
    outer = torch.rand(4)
    torch.manual_seed(7)
    assert outer.numpy().tobytes() == torch.rand(4).numpy().tobytes()


def test_eager_jit_fuser_leaves_megatrons_fused_functions_unchanged_without_importing_dynamo():
    """In a fresh interpreter (a rank's start): after eager_jit_fuser, megatron-core imports with its
    ``jit_fuser`` functions as written and Dynamo never imported; a launcher's other value is kept."""
    import os
    import subprocess
    import sys

    probe = (
        "import sys, torch\n"
        "from megatron_bitdet.compat.cpu_backend import eager_jit_fuser\n"
        "print(eager_jit_fuser())\n"
        "import megatron.core\n"
        "from megatron.core.fusions import fused_bias_gelu\n"
        "fn = fused_bias_gelu.bias_gelu\n"
        "print(type(fn).__name__, fn.__module__, 'torch._dynamo' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["['eager_jit_fuser']", "function megatron.core.fusions.fused_bias_gelu False"]
    keep = "import os, torch\nfrom megatron_bitdet.compat.cpu_backend import eager_jit_fuser\n" \
           "print(eager_jit_fuser(), os.environ['TORCHDYNAMO_DISABLE'], torch.compile.__module__)"
    kept = subprocess.run([sys.executable, "-c", keep], env={**env, "TORCHDYNAMO_DISABLE": "0"},
                          capture_output=True, text=True, check=True)
    assert kept.stdout.strip() == "[] 0 torch"
