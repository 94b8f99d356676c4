"""One rank of ``bitdet replay``: ``train.worker.worker`` with four step hooks (a Megatron-LM run's: the
entry point's rank, ``megatron_replay_worker``, with all but ``Verify`` as the Megatron-LM hooks' step hooks).

- ``Verify`` compares every replayed step's fingerprint line with the original run's, bit for bit, and
  stops every rank after the first step that differs on any rank (one all-reduce of a flag per step);
- ``Change`` applies one counterfactual change at the replayed step only;
- ``Stats`` records per-module statistics of each step (``trace.module_stats``);
- ``Dump`` saves one module's inputs, outputs and output gradients at the step.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.fingerprint.steps import read_rank_file
from megatron_bitdet.rundir import fingerprint_path
from megatron_bitdet.trace.digest import trace_tensors
from megatron_bitdet.trace.module_stats import ModuleStats, StatsWriter
from megatron_bitdet.train.loop import StepHook
from megatron_bitdet.train.worker import enforce, worker


class Verify(StepHook):
    def __init__(self, original: str, rank: int, until: int):
        self.expected = {r.step: r for r in read_rank_file(fingerprint_path(original, rank), rank)}
        self.until = until

    def end(self, step, line):
        if step > self.until:
            return False
        want = self.expected.get(step)
        same = want is not None and line["metrics"] == want.metrics and line["digests"] == want.digests
        flag = torch.tensor([0 if same else 1], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


def _expert_offset(state) -> int:
    from megatron.core import parallel_state as ps

    moe = state.recipe.model.moe
    return ps.get_expert_model_parallel_rank() * (moe.num_experts // state.recipe.parallel.expert) \
        if moe.num_experts else 0


def resolve_module(state, name: str):
    """The module named as in the ranking (``expert_<global id>`` for an expert); None when another
    expert-parallel rank holds that expert."""
    modules = dict(state.ddp_modules[0].module.named_modules())
    m = re.fullmatch(r"(.*\.experts)\.expert_(\d+)(\..*)?", name)
    if m and m.group(1) in modules:
        local = int(m.group(2)) - _expert_offset(state)
        if not 0 <= local < modules[m.group(1)].num_local_experts:
            return None
        name = f"{m.group(1)}.local_experts.{local}{m.group(3) or ''}"
    if name not in modules:
        near = [n for n in modules if n.endswith(name.rpartition(".")[2])][:5]
        raise BitdetInputError(f"no module {name!r} in the model (e.g. {', '.join(near) or 'decoder.layers.0'})")
    return modules[name]


class Stats(StepHook):
    def __init__(self, run_dir: str, rank: int, steps: list[int]):
        self.run_dir, self.rank, self.steps = run_dir, rank, range(steps[0], steps[1] + 1)
        self.stats = self.writer = self._finalize = None

    def begin(self, step, state, batches):
        if step not in self.steps:
            return batches
        if self.stats is None:
            self.stats = ModuleStats.for_chunks([m.module for m in state.ddp_modules],
                                                expert_offset=_expert_offset(state))
            self.writer = StatsWriter(self.run_dir, self.rank, {"steps": [self.steps[0], self.steps[-1]]})
        config, finalize = state.config, state.config.finalize_model_grads_func

        def grads_then_reduce(*args, **kwargs):
            self.stats.grads_ready()  # before the data-parallel reduction: this rank's own gradient
            return finalize(*args, **kwargs)

        self._finalize = (config, finalize)
        config.finalize_model_grads_func = grads_then_reduce
        self.stats.begin()
        return batches

    def end(self, step, line):
        if step in self.steps:
            config, finalize = self._finalize
            config.finalize_model_grads_func = finalize
            self.writer.write(step, self.stats.end())
            if step == self.steps[-1]:
                self.writer.close()
        return False


def _zero_loss_mask(batches, index: int):
    for i, batch in enumerate(batches):
        yield {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])} if i == index else batch


class Change(StepHook):
    """``{"kind": "skip-microbatch", "index": M, "rank": R | None}``, ``{"kind": "zero-expert", "layer": L,
    "expert": E}`` or ``{"kind": "prev-params", "module": NAME}``, applied at ``step``. A module's previous
    params are copied in by a forward pre-hook at its first call in the step, so they also replace what
    an earlier hook (a planted fault) did to them."""

    def __init__(self, change: dict, step: int, rank: int):
        self.change, self.step, self.rank = change, step, rank
        self.saved = None
        self.handle = None

    def begin(self, step, state, batches):
        c = self.change
        if c["kind"] == "prev-params" and step == self.step - 1:
            module = resolve_module(state, c["module"])
            self.saved = None if module is None else [p.detach().clone() for p in module.parameters()]
        if step != self.step:
            return batches
        if c["kind"] == "skip-microbatch":
            if c.get("rank") is None or c["rank"] == self.rank:
                return _zero_loss_mask(batches, c["index"])
        elif c["kind"] == "zero-expert":
            router = resolve_module(state, f"decoder.layers.{c['layer']}.mlp.router")
            keep = torch.ones(state.recipe.model.moe.num_experts)
            keep[c["expert"]] = 0.0

            def zero(module, args, output):
                probs, routing_map = output
                return probs * keep.to(probs.device, probs.dtype), routing_map

            self.handle = router.register_forward_hook(zero)
        elif c["kind"] == "prev-params" and self.saved is not None:
            saved = self.saved

            def restore(module, args):
                with torch.no_grad():
                    for p, old in zip(module.parameters(), saved):
                        p.copy_(old)
                self.handle.remove()
                self.handle = None

            self.handle = resolve_module(state, c["module"]).register_forward_pre_hook(restore)
        return batches

    def end(self, step, line):
        if step == self.step and self.handle is not None:
            self.handle.remove()
            self.handle = None
        return False


class Dump(StepHook):
    """Saves one module's inputs, outputs and output gradients at ``step`` (every call) to ``path``
    (``torch.load(path, weights_only=True)``: {"module", "dumped", "step", "calls": [{"inputs", "outputs",
    "grad_outputs"}]})."""

    def __init__(self, module: str, step: int, path: str):
        self.module, self.step, self.path = module, step, path
        self.calls: list[dict] = []
        self.handle = None

    def begin(self, step, state, batches):
        if step != self.step:
            return batches
        if resolve_module(state, self.module) is None:
            raise BitdetInputError(f"--dump: rank {torch.distributed.get_rank()} does not hold {self.module}")
        expert = re.fullmatch(r"(.*\.experts)\.expert_(\d+)", self.module)
        # an expert's rows are in its container's input and output, split by tokens_per_expert (the grouped
        # implementation never calls the expert module itself)
        self.dumped = expert.group(1) if expert else self.module
        module = resolve_module(state, self.dumped)

        def keep(mod, args, kwargs, output):
            call = {"inputs": [t.detach().clone() for t in trace_tensors((args, kwargs))],
                    "outputs": [t.detach().clone() for t in trace_tensors(output)], "grad_outputs": []}
            self.calls.append(call)
            for t in trace_tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda g, c=call: c["grad_outputs"].append(g.detach().clone()))

        self.handle = module.register_forward_hook(keep, with_kwargs=True)
        return batches

    def end(self, step, line):
        if step == self.step:
            self.handle.remove()
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            torch.save({"module": self.module, "dumped": self.dumped, "step": step, "calls": self.calls}, self.path)
        return False


def _step_hooks(rank: int, replay: dict, run_dir: str) -> list[StepHook]:
    """``replay``: {"original", "verify_until", "stats_steps": [a, b] | None, "change": dict | None, "step",
    "dump": {"module", "rank", "path"} | None, "other_dp": bool}."""
    hooks = []
    dump = replay.get("dump")
    if dump and dump["rank"] == rank:
        hooks.append(Dump(dump["module"], replay["step"], dump["path"]))
    if replay.get("change"):  # before Stats: its hooks then see the changed step
        hooks.append(Change(replay["change"], replay["step"], rank))
    if replay.get("stats_steps"):
        hooks.append(Stats(run_dir, rank, replay["stats_steps"]))
    return hooks


def replay_worker(rank: int, world_size: int, *, replay: dict, **train_args) -> int:
    # at another data-parallel size a rank's digests are partials: the steps are compared afterwards
    verify = [] if replay.get("other_dp") else [Verify(replay["original"], rank, replay["verify_until"])]
    hooks = [*verify,
             *_step_hooks(rank, replay, train_args["options"]["run_dir"])]
    return worker(rank, world_size, hooks=hooks, **train_args)


replay_worker.before_process_group = enforce


def megatron_replay_worker(rank: int, world_size: int, *, script: str, argv: list, replay: dict) -> int:
    """One rank of a Megatron-LM run's replay: the entry point's rank with the change and the statistics as
    the Megatron-LM hooks' step hooks. No ``Verify``: Megatron-LM stops at ``--exit-interval`` (K), and the
    replayed steps are compared with the original's afterwards."""
    from megatron_bitdet.megatron_lm import entry, loop_hooks

    loop_hooks.STEP_HOOKS.extend(_step_hooks(rank, replay, replay["run_dir"]))
    return entry.rank_worker(rank, world_size, script=script, argv=argv)


megatron_replay_worker.owns_process_group = True
