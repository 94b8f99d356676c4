"""What a training step's fingerprint line holds, taken from megatron's DDP buffers and the model's
other state (the line's format and writer: ``fingerprint.steps``; the digests' algorithm, slicing and
per-rank cost: ``fingerprint.shards``)."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_bitdet.fingerprint import logical
from megatron_bitdet.fingerprint.shards import (
    CHECK_CHUNKS, Group, Job, Layout, Pending, chunk_rows, combine, named_digest, slice_rows,
)


def moe_aux_losses(num_microbatches: int, *, names=None, clear: bool = True) -> dict:
    """Per-layer load-balancing losses from megatron's tracker (``names``: only these entries).
    Megatron-LM's own logging reduces and clears the tracker after the step, so under it the rank's
    own values are read without clearing (``clear=False``)."""
    import torch

    from megatron_bitdet.compat import moe_tracker

    out = {}
    for name, entry in moe_tracker.entries().items():
        if names is not None and name not in names:
            continue
        values = entry["values"] / num_microbatches
        for layer, v in enumerate(values):
            if v != 0:
                out[f"{name}/layer_{layer + 1:02d}"] = v.to(torch.float32)
    if clear:
        moe_tracker.clear()
    return out


def step_metrics(*, lm_loss, aux: dict, aux_coeff: float, grad_norm, lr, num_zeros=None) -> dict:
    """The metrics of one fingerprint line, for bitdet's loop and Megatron-LM's alike."""
    aux_total = sum(aux.values()) * aux_coeff if aux else None
    return {
        "loss": None if lm_loss is None else (lm_loss + aux_total if aux_total is not None else lm_loss),
        "lm_loss": lm_loss,
        "aux_loss": aux_total,
        **{f"aux_loss/{k}": v for k, v in aux.items()},
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "num_zeros": None if num_zeros is None else float(num_zeros),
        "lr": float(lr),
    }


def ddp_buffers(ddp_modules, attr: str) -> list:
    """megatron DDP's contiguous ``param_data`` or ``grad_data`` buffers on this rank, dense then expert."""
    return [getattr(b, attr) for m in ddp_modules for b in (*m.buffers, *m.expert_parallel_buffers)]


@dataclass
class Region:
    """A DDP buffer's tensors of one kind (``params``, ``grads``, ``main_params``, an optimizer state
    such as ``exp_avg``) and its replicas. ``sharded``: megatron's owned shard (distributed optimizer,
    or the params before an overlapped all-gather), held by this rank alone: digested whole;
    otherwise the tensors are replicated over ``group`` and each member digests its slice."""

    kind: str
    buf: str
    tensors: list
    group: Group
    sharded: bool

    def __post_init__(self):
        self.layout = Layout.of(self.tensors)

    def check_chunk(self, step: int) -> tuple[int, int, int]:
        """(owner, first row, end row) of the chunk every replica digests at ``step``: chunk
        ``step mod (D*K)`` of the region in slice order (slice ``q // K``'s chunk ``q mod K``), so
        within ``D*K`` consecutive steps every replica's copy of every chunk is digested at the same
        step as all the others' (``analysis.replicas`` takes the majority)."""
        g = self.group
        q = step % (g.size * CHECK_CHUNKS)
        owner = q // CHECK_CHUNKS
        a, b = chunk_rows(*slice_rows(self.layout.rows, owner, g.size), CHECK_CHUNKS)[q % CHECK_CHUNKS]
        return owner, a, b

    def jobs(self, step: int) -> list[Job]:
        """This step's own slice (``CHECK_CHUNKS`` chunks with replicas) and, unless this rank owns
        it, the step's check chunk (``check_chunk``)."""
        rows, g = self.layout.rows, self.group
        if self.sharded or g.size == 1:
            return [Job(self.tensors, self.layout, 0, rows, [(0, rows)], (self, None))]
        lo, hi = slice_rows(rows, g.index, g.size)
        own = Job(self.tensors, self.layout, lo, hi, chunk_rows(lo, hi, CHECK_CHUNKS), (self, None))
        owner, a, b = self.check_chunk(step)
        if owner == g.index:
            return [own]
        return [own, Job(self.tensors, self.layout, a, b, [(a, b)], (self, owner))]

    def record(self, owner, parts) -> dict:
        rec = {"kind": self.kind, "buf": self.buf, "group": self.group.key, "index": self.group.index,
               "of": self.group.size}
        if owner is None:
            rec.update(sharded=self.sharded, bytes=self.layout.total)
        else:
            rec["check_of"] = owner
        rec["parts"] = [list(p) for p in parts]
        return rec


def _buffer_params(buffer) -> list:
    """A DDP buffer's params in buffer order."""
    return sorted(buffer.params, key=lambda p: buffer.param_index_map[p][0])


def _owned(buffer, attr: str, group: Group) -> list:
    """This rank's shard of each bucket's ``param_data`` / ``grad_data``, as megatron cuts it."""
    out = []
    for bucket in buffer.buckets:
        data = getattr(bucket, attr)
        size = data.numel() // group.size
        out.append(data[size * group.index:size * (group.index + 1)])
    return out


def ddp_regions(ddp_modules) -> list[Region]:
    """Every DDP buffer as regions, in a fixed order (chunk, dense then expert, kind): params (the
    all-gathered ``param_data``, or the params themselves where megatron keeps none; the owned shard
    when the all-gather overlaps the next forward), grads (with the distributed optimizer the shard
    this rank owns after the reduce-scatter, per bucket as megatron cuts it), and the fp32 main params
    of 16-bit params."""
    regions = []
    for name, b, group in _buffers(ddp_modules):
        distopt = b.ddp_config.use_distributed_optimizer
        params = _buffer_params(b)
        if distopt and b.ddp_config.overlap_param_gather:
            # the all-gather runs in the next forward: after the step only the owned shard is new
            regions.append(Region("params", name, _owned(b, "param_data", group), group, True))
        else:
            regions.append(Region("params", name, [b.param_data] if b.param_data is not None
                                  else [p.detach() for p in params], group, False))
        if distopt:
            regions.append(Region("grads", name, _owned(b, "grad_data", group), group, True))
        else:
            regions.append(Region("grads", name, [b.grad_data], group, False))
        mains = [p.main_param for p in params if getattr(p, "main_param", None) is not None]
        if mains:
            sharded = any(getattr(p, "main_param_sharded", False) for p in params)
            regions.append(Region("main_params", name, mains, group, sharded))
    return regions


def _buffers(ddp_modules):
    """(name, buffer, group) of every DDP buffer, in the regions' order (chunk, dense then expert)."""
    for ci, m in enumerate(ddp_modules):
        for family, buffers in (("dense", m.buffers), ("expert", m.expert_parallel_buffers)):
            for bi, b in enumerate(buffers):
                yield f"{ci}.{family}.{bi}", b, Group.of(b.data_parallel_group)


def optimizer_regions(ddp_modules, optimizer) -> list[Region] | None:
    """The optimizer's per-element state of each DDP buffer's params (Adam's ``exp_avg``,
    ``exp_avg_sq``: every state tensor shaped like its parameter), one region per state key and
    buffer, in buffer order, replicated over the buffer's group. Only without the distributed
    optimizer: with it each rank holds its own shard's state, no replica (``replica_coverage`` says
    so). None while the optimizer has made no state yet (torch's Adam makes it at its first step);
    scalar state (Adam's per-param step count) is not a buffer and is left out."""
    import torch

    if optimizer is None:
        return []
    states = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        state = getattr(getattr(opt, "optimizer", None), "state", None)
        if state is None:  # not a megatron optimizer over a torch one: its state is not known here
            return []
        states.update(state)
    regions = []
    for name, b, group in _buffers(ddp_modules):
        if b.ddp_config.use_distributed_optimizer:
            continue
        keys = [p.main_param if getattr(p, "main_param", None) is not None else p for p in _buffer_params(b)]
        per = [states.get(k) for k in keys]
        if any(not st for st in per):
            return None
        for key in sorted(per[0]):
            tensors = [st.get(key) for st in per]
            if all(isinstance(t, torch.Tensor) and t.shape == k.shape and t.dim() for t, k in zip(tensors, keys)):
                regions.append(Region(key, name, tensors, group, False))
    return regions


def replica_coverage(ddp_modules) -> list[dict]:
    """What the replica check (``bitdet check``) can cover in this layout, per DDP buffer and kind:
    ``replicas`` (the data-parallel group's size) and ``layout``: ``replicated`` (every replica's
    copy digested at the same step as the others', each chunk within ``bound_steps`` = replicas x
    CHECK_CHUNKS steps), ``owned shard`` (the distributed optimizer's, or the params before an
    overlapped all-gather: one holder, nothing to compare: ``why``) or ``one replica``. The
    manifest records it (``replica_check``); ``optimizer`` is the optimizer's per-element state."""
    out = []
    for name, b, group in _buffers(ddp_modules):
        distopt = b.ddp_config.use_distributed_optimizer
        mixed = any(getattr(p, "main_param", None) is not None or getattr(p, "main_param_sharded", False)
                    for p in b.params)
        kinds = {"params": "overlap-param-gather: only the owned shard is the step's"
                 if distopt and b.ddp_config.overlap_param_gather else None,
                 "grads": "distributed optimizer: the reduce-scatter's owned shard" if distopt else None}
        if mixed:
            kinds["main_params"] = "distributed optimizer: owned shard" if distopt else None
        kinds["optimizer"] = "distributed optimizer: owned shard" if distopt else None
        for kind, why in kinds.items():
            entry = {"kind": kind, "buf": name, "replicas": group.size}
            if group.size == 1:
                entry["layout"] = "one replica"
            elif why:
                entry.update(layout="owned shard", why=why)
            else:
                entry.update(layout="replicated", bound_steps=group.size * CHECK_CHUNKS)
            out.append(entry)
    return out


def _coordinates(expert: bool) -> str:
    """The model-parallel coordinates a parameter's logical key carries (its name repeats across them):
    TP and PP ranks; for expert parameters the EP and expert-TP ranks (a dense parameter is replicated
    across EP ranks, which are data-parallel ranks for it)."""
    from megatron.core import parallel_state as ps

    if expert:
        return (f"pp{ps.get_pipeline_model_parallel_rank()}.ep{ps.get_expert_model_parallel_rank()}"
                f".etp{ps.get_expert_tensor_parallel_rank()}")
    return f"tp{ps.get_tensor_model_parallel_rank()}.pp{ps.get_pipeline_model_parallel_rank()}"


def _optimizer_targets(optimizer, params) -> dict:
    """param -> (torch optimizer, the tensor it updates for the param, keying its state): the distributed
    optimizer's shard (an fp32 main-param shard, or a view of an fp32 param's shard), else a 16-bit
    param's fp32 main param, else the param. A param this rank's optimizer does not update (another
    rank's shard) is left out."""
    inners, shards = [], {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]) if optimizer is not None else []:
        inners.append(opt.optimizer)
        if hasattr(opt, "shard_fp32_groups"):  # megatron's DistributedOptimizer
            for models, shard_groups in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                         (opt.model_fp32_groups, opt.shard_fp32_groups)):
                for group, shard_group in zip(models, shard_groups):
                    shards.update(zip(group, shard_group))
    holder = {id(t): inner for inner in inners for g in inner.param_groups for t in g["params"]}
    out = {}
    for p in params:
        t = shards.get(p)
        if t is None:
            t = p.main_param if getattr(p, "main_param", None) is not None else p
        if id(t) in holder:
            out[p] = (holder[id(t)], t)
    return out


def _state_view(inner, target, first: int, n: int):
    """() -> {state name: flat view of elements ``first .. first + n``} of ``target``'s per-element
    optimizer state (Adam's ``exp_avg``, ``exp_avg_sq``; read when called: torch makes the state at the
    first step, and a restore replaces it)."""
    import torch

    def get():
        return {k: v.view(-1)[first:first + n] for k, v in sorted(inner.state.get(target, {}).items())
                if torch.is_tensor(v) and v.dim() and v.numel() == target.numel()}
    return get


def logical_pieces(ddp_modules, optimizer=None) -> dict[str, list]:
    """kind -> [(key, offset, get)]: the logical elements this rank digests, ``get()`` giving the live
    flat view of elements ``offset ..`` of the parameter keyed ``key``. Each bucket of a DDP buffer is
    split over its data-parallel group as the distributed optimizer shards it (rank i: the i-th of
    ``of`` equal parts; without it the same split of the replicated buffer), so every element of a
    replicated kind is digested by exactly one rank: params, grads (with the distributed optimizer the
    reduced shard), fp32 main params (sharded: exactly that shard), and ``optimizer``: ``get()`` gives
    {state name: view} of ``optimizer``'s per-element state of those elements (with the distributed
    optimizer its shard, which is exactly the piece)."""
    out: dict[str, list] = {"params": [], "grads": [], "main_params": [], "optimizer": []}
    for ci, m in enumerate(ddp_modules):
        names = {p: n for n, p in m.module.named_parameters()}
        for b in (*m.buffers, *m.expert_parallel_buffers):
            where = _coordinates(b in m.expert_parallel_buffers)
            group = Group.of(b.data_parallel_group)
            targets = _optimizer_targets(optimizer, b.params)
            for bucket in b.buckets:
                n = bucket.grad_data.numel()
                lo = bucket.offset + n * group.index // group.size
                hi = bucket.offset + n * (group.index + 1) // group.size
                for p in bucket.params_list:
                    start, end, _ = b.param_index_map[p]
                    a, z = max(start, lo), min(end, hi)
                    if a >= z:
                        continue
                    key = logical.name_key(f"{ci}.{names[p]}@{where}")
                    pdata = (lambda b=b, a=a, z=z: b.param_data[a:z]) if b.param_data is not None else \
                        (lambda p=p, a=a - start, z=z - start: p.detach().view(-1)[a:z])
                    out["params"].append((key, a - start, pdata))
                    out["grads"].append((key, a - start, lambda b=b, a=a, z=z: b.grad_data[a:z]))
                    if getattr(p, "main_param", None) is not None:
                        sharded = getattr(p, "main_param_sharded", False)
                        out["main_params"].append((key, a - start, (lambda p=p: p.main_param.view(-1)) if sharded
                                                   else (lambda p=p, a=a - start, z=z - start: p.main_param.view(-1)[a:z])))
                    if p in targets:
                        inner, t = targets[p]
                        first = 0 if t.numel() == z - a else a - start  # a shard is the piece; else the whole
                        out["optimizer"].append((key, a - start, _state_view(inner, t, first, z - a)))
    return out


def logical_sums(pieces: dict, kinds) -> dict:
    """{``logical_<kind>``: a 0-d int64 tensor}: this rank's partial logical digests of ``kinds`` of
    ``logical_pieces``, summed on the device (nothing read back); ``optimizer`` gives one per state
    name (``logical_exp_avg``, ``logical_exp_avg_sq``)."""
    import torch

    sums: dict[str, list] = {}
    for kind in kinds:
        for key, offset, get in pieces[kind]:
            views = get() if kind == "optimizer" else {kind: get()}
            for name, flat in views.items():
                sums.setdefault(f"logical_{name}", []).append(logical.partial_sum(flat, key, offset))
    return {name: torch.stack(partials).sum() for name, partials in sums.items()}


def logical_partials(ddp_modules, optimizer) -> dict[str, str]:
    """This rank's partial logical digests of its params, fp32 main params and optimizer state, read
    back now (a snapshot, outside a step): {``params``, ``exp_avg``, ...: ``lsum64:<hex>``}; the
    ranks' partials of a name added (``logical.combine_partials``) do not depend on the DP size."""
    import torch

    sums = logical_sums(logical_pieces(ddp_modules, optimizer), ("params", "main_params", "optimizer"))
    names = sorted(sums)
    values = torch.stack([sums[n] for n in names]).tolist() if names else []
    return {n.removeprefix("logical_"): logical.encode(v) for n, v in zip(names, values)}


class StepDigests:
    """One rank's per-step digests (fingerprint format v3), launched on the state's device with no
    host sync — ``grads`` right before the optimizer consumes them, ``state`` after the step — and read
    back once, by ``resolve``, at the log point. The regions are made at the first step; the model's
    small state (buffers, generators, FP8) is found by one walk, redone only when a count of the
    modules' attributes, buffers and children changes (an attribute rebound to another generator
    without changing that count is found at the next walk: checkpoints and snapshots walk anew)."""

    def __init__(self, ddp_modules, *, optimizer=None, logical_digests: bool = False):
        self.model = list(ddp_modules)
        self.optimizer = optimizer          # its per-element state is digested too (``optimizer_regions``)
        self._opt_regions: list[Region] | None = None
        self.logical = logical_digests  # dp_invariant: also the layout-free digests (``logical_pieces``)
        self._pieces: dict | None = None
        self._partials: dict[str, object] = {}
        self.pending = Pending()
        self._regions: list[Region] | None = None
        self._dicts: list | None = None     # every module's __dict__, _buffers and _modules: their sizes
        self._signature = None              # summed are the structure count
        self._sources = None
        self._seq = 0
        self._small: dict[str, str] = {}

    def _launch(self, jobs: list[Job]) -> None:
        for job in jobs:
            job.tag = (self._seq, job.tag)
            self._seq += 1
        self.pending.launch(jobs)

    def regions(self) -> list[Region]:
        """The DDP buffers' regions, then the optimizer state's once the optimizer has made it."""
        if self._regions is None:
            self._regions = ddp_regions(self.model)
        if self._opt_regions is None:
            self._opt_regions = optimizer_regions(self.model, self.optimizer)
        return self._regions + (self._opt_regions or [])

    def _launch_logical(self, kinds) -> None:
        """This rank's partial logical digest of each kind, summed on the device (read in ``resolve``)."""
        if not self.logical:
            return
        if self._pieces is None:
            self._pieces = logical_pieces(self.model, self.optimizer)
        self._partials.update(logical_sums(self._pieces, kinds))

    def grads(self, step: int) -> None:
        """Launch the reduced grads' digests (before the optimizer step consumes or clips them)."""
        self._launch([j for r in self.regions() if r.kind == "grads" for j in r.jobs(step)])
        self._launch_logical(("grads",))

    def state(self, step: int) -> None:
        """Launch the digests of the state the step left: params, main params, the optimizer's
        replicated per-element state, the model's buffers, its generators' states, FP8 encoded weights
        and scaling state, NVFP4 encodings."""
        self._launch([j for r in self.regions() if r.kind != "grads" for j in r.jobs(step)])
        self._launch_logical(("params", "main_params", "optimizer"))
        jobs = []
        for kind, named in self._small_state().items():
            job, self._small[kind] = named_digest(named, kind)
            jobs.append(job)
        self._launch(jobs)

    def _small_state(self) -> dict[str, list]:
        from megatron_bitdet.kernels.fp4_linear import emulated_fp4_modules
        from megatron_bitdet.kernels.fp8_linear import emulated_fp8_modules
        from megatron_bitdet.train.module_state import generator_sources, module_buffer_sources, walk
        from megatron_bitdet.train.precision import fp4_encodings, fp8_scaling_state

        chunks = [m.module for m in self.model]
        if self._dicts is None:
            self._dicts = [d for c in chunks for m in c.modules() for d in (m.__dict__, m._buffers, m._modules)]
        signature = sum(map(len, self._dicts))  # at C speed: no Python loop over the modules
        if signature != self._signature:
            walked = walk(chunks)
            self._dicts = [d for _, _, m in walked for d in (m.__dict__, m._buffers, m._modules)]
            fp8 = emulated_fp8_modules(walked)
            held = [t for t in walked if fp8_scaling_state(None, [t])]
            self._sources = (module_buffer_sources(walked), generator_sources(walked), fp8, held,
                             emulated_fp4_modules(walked))
            self._signature = signature
        buffers, generators, fp8, held, fp4 = self._sources
        out = {"buffers": [(n, m._buffers[k]) for n, m, k in buffers if m._buffers.get(k) is not None]}
        if generators:
            out["generators"] = [(n, g.get_state()) for n, g in generators]
        encoded = [(n, m.fp8_encoded_weight) for n, m in fp8 if m.fp8_encoded_weight is not None]
        if encoded:
            out["fp8_values"] = [(n, e.data) for n, e in encoded]
            out["fp8_scales"] = [*((n, e.scales) for n, e in encoded), *fp8_scaling_state(None, held).items()]
        if fp4:
            out["fp4_values"], out["fp4_scales"] = fp4_encodings(fp4)
        return out

    def resolve(self) -> tuple[dict[str, str], list[dict]]:
        """(digests by kind, slice records) of everything launched since the last call: one transfer
        per device. A DDP kind's digest folds this rank's own chunks; the records let the reader
        combine a step's digest across replicas and compare replicas (``analysis.replicas``)."""
        own: dict[str, list[str]] = {}
        small: dict[str, list[str]] = {}
        algo: dict[str, str] = {}
        records = []
        for job, parts in sorted(self.pending.resolve(), key=lambda jp: jp[0].tag[0]):
            _, tag = job.tag
            algo[tag if isinstance(tag, str) else tag[0].kind] = job.algo
            if isinstance(tag, str):
                small.setdefault(tag, []).extend(h for _, _, h in parts)
                continue
            region, owner = tag
            records.append(region.record(owner, parts))
            if owner is None:
                own.setdefault(region.kind, []).extend(f"{region.buf}:{lo}-{hi}:{h}" for lo, hi, h in parts)
        digests = {}
        fixed = ("params", "grads", "buffers", "generators", "main_params", "fp8_values", "fp8_scales",
                 "fp4_values", "fp4_scales")
        for kind in (*fixed, *sorted(own.keys() - set(fixed))):  # then the optimizer's state kinds
            if kind in own:
                digests[kind] = f"{algo[kind]}:{combine(own[kind])}"
            elif kind in small:
                digests[kind] = f"{algo[kind]}:{combine([self._small[kind], *small[kind]])}"
        if self._partials:
            import torch

            names = sorted(self._partials)
            for name, total in zip(names, torch.stack([self._partials[n] for n in names]).tolist()):
                digests[name] = logical.encode(total)
            self._partials.clear()
        self._small.clear()
        return digests, records
