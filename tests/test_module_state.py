"""State a model holds outside its parameters, found by walking the modules: generators and buffers."""
import pytest
import torch

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.fingerprint import state_digest
from megatron_bitdet.train.module_state import (capture_module_rng, module_buffers, module_generators,
                                                restore_module_rng)


def buffers_digest(modules):
    return state_digest(module_buffers(modules).items())


def generators_digest(modules):
    states = capture_module_rng(modules)
    return state_digest(states.items()) if states else None


class Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)
        self.inner.noise = torch.Generator().manual_seed(1)
        self.pool = [torch.Generator().manual_seed(2)]
        self.register_buffer("bias", torch.zeros(3))


def test_generators_are_found_restored_and_digested():
    model = Holder()
    assert sorted(module_generators([model])) == ["0.<root>:pool[0]", "0.inner:noise"]
    saved, digest = capture_module_rng([model]), generators_digest([model])
    first = torch.randn(4, generator=model.inner.noise)
    assert generators_digest([model]) != digest  # the digest follows the generator's state
    restore_module_rng([model], saved, source="ckpt")
    assert generators_digest([model]) == digest
    assert torch.equal(torch.randn(4, generator=model.inner.noise), first)
    before = buffers_digest([model])
    model.bias += 1
    assert buffers_digest([model]) != before
    assert generators_digest([torch.nn.Linear(2, 2)]) is None


def test_generators_in_containers_are_named_by_their_path_two_levels_deep():
    model = torch.nn.Linear(2, 2)
    a, b, c, d = (torch.Generator().manual_seed(i) for i in range(4))
    model.pools = {"a": [a], "b": (b,)}
    model.deep = [[[c]]]  # three levels: not looked into
    model.again = [a]     # reachable twice: named by its first path
    model.flat = d
    assert list(module_generators([model])) == ["0.<root>:pools['a'][0]", "0.<root>:pools['b'][0]", "0.<root>:flat"]


def test_a_generator_the_checkpoint_does_not_carry_is_named():
    model = Holder()
    with pytest.raises(BitdetInputError, match=r"ckpt: module 0.inner holds torch.Generator 'noise', which the "
                                               r"checkpoint does not carry"):
        restore_module_rng([model], {"0.<root>:pool[0]": model.pool[0].get_state()}, source="ckpt")
