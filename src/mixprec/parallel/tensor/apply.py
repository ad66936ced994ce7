"""Applying a tensor-parallel plan to a model at ``prepare()``, and reading it back whole.

Order at ``prepare()`` (parallel/tensor/plan.py chooses, parallel/tensor/layers.py splits):
every rank of the world checks it built the same model and takes rank 0's values (so the
slices of one weight on different ranks come from one tensor); the modules the plan splits
are swapped to their split classes with this rank's slices as parameters; TP ranks take TP
rank 0's RNG state (dropout on replicated activations draws the same mask on each); then
the data-parallel engine prepares the split model over the DP group as it would any model.

``TPLayout`` records, for every split parameter, its dimension and sub-parameter sizes:
``full_state_dict`` turns a state dict of local slices into full tensors (a collective over
the TP group), which ``get_state_dict``, ``save_model`` and ``save_16bit_model`` use.
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...distributed.devices import group_device
from .layers import TPGroup, check_divisible, full_from_local, replicate_kv_module, split_module, style_dim
from .plan import SPLIT_STYLES, LayerPlan, PlanError, nothing_split_message, resolve_plan

# Attributes attention modules keep their head counts in (a split module sees its own).
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_key_value_heads", "num_kv_heads",
               "n_kv_heads", "num_key_value_heads_per_partition", "split_size")
_KV_NAMES = ("k_proj", "v_proj", "key", "value")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "num_key_value_heads_per_partition")


class InputMismatchError(RuntimeError):
    """The ranks of one TP group were given different inputs."""


@dataclasses.dataclass
class TPLayout:
    """Where each split parameter of a prepared model comes from (see the module docstring)."""

    tp: TPGroup
    plans: dict[str, LayerPlan]
    split: dict[str, tuple[int, Optional[tuple]]]  # parameter name -> (dim, sub-parameter sizes)
    full_shapes: dict[str, tuple]
    split_ids: set = dataclasses.field(default_factory=set)
    grad_allreduce_ids: set = dataclasses.field(default_factory=set)
    # id(parameter before the split) -> (weak reference to it, the split parameter that
    # replaced it): an optimizer built before prepare() holds the former
    # (swap_optimizer_params). The weak reference tells a reused id from the original.
    replaced: dict = dataclasses.field(default_factory=dict)

    def replacement(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        entry = self.replaced.get(id(p))
        return entry[1] if entry is not None and entry[0]() is p else None

    def describe(self) -> dict[str, str]:
        """Parameter name -> its partition ("replicated" where not split)."""
        out = {}
        for pname, (dim, sizes) in sorted(self.split.items()):
            module = pname.rpartition(".")[0]
            plan = self.plans.get(module)
            out[pname] = (f"{plan.describe() if plan else 'split'}: global {list(self.full_shapes[pname])}, "
                          f"local dim {dim} / {self.tp.size}")
        return out

    def full_state_dict(self, state: dict) -> dict:
        """``state`` (model keys -> local tensors) with every split tensor made whole: a
        collective over the TP group (every rank calls it, in the same key order)."""
        out = dict(state)
        for key in sorted(k for k in state if k in self.split):
            dim, sizes = self.split[key]
            t = state[key]
            out[key] = full_from_local(t.detach(), dim, self.tp, sizes)
        return out


def _head_dim(model: nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    if config is None:
        return None
    hd = getattr(config, "head_dim", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if isinstance(hd, int) and hd > 0:
        return hd
    if isinstance(heads, int) and isinstance(hidden, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None


def _kv_heads(model: nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    return getattr(config, "num_key_value_heads", None) if config is not None else None


def apply_tensor_parallel(model: nn.Module, tp_config: Any, tp: TPGroup, *, world_group: Any = None,
                          device: Optional[torch.device] = None) -> TPLayout:
    """Split ``model`` in place by its plan for this rank of ``tp`` (see the module docstring).
    A model built on the meta device is materialised module by module, each split module
    right before its split ([Note: materialising a meta model shard by shard] in
    parallel/materialize.py)."""
    from ...engines.comm import broadcast_chunks, start_replicas
    from ..materialize import Materializer, has_meta, trim_heap

    materializer = Materializer(model, device or torch.device("cpu"), world_group) if has_meta(model) else None
    # The parameters that hold rank 0's values already (sent, or materialised: equal on every
    # rank). Weak references: a split frees whole parameters, and a later one may reuse an id.
    sent: dict = {}

    def mark(p) -> None:
        sent[id(p)] = weakref.ref(p)

    def rank0_values(params) -> None:
        """Rank 0's values of ``params`` (real ones not sent yet), right before their module
        is split: a rank holds the whole model once, plus one module's received copy
        ([Note: rank 0's values, a core at a time] in engines/zero.py)."""
        todo = [p for p in dict.fromkeys(params)
                if not p.is_meta and not (id(p) in sent and sent[id(p)]() is p)]
        for p in todo:
            mark(p)
        if world_group is not None:
            broadcast_chunks(todo, world_group)

    if world_group is not None:
        start_replicas(model, world_group, world_group.group_name, params=False)
    plans = resolve_plan(model, tp_config)
    if tp.size > 1 and not any(p.style in SPLIT_STYLES for p in plans.values()):
        raise PlanError(nothing_split_message(model, tp_config, tp.size))
    head_dim = _head_dim(model)
    kv = _kv_heads(model)
    modules = dict(model.named_modules())
    for name, plan in plans.items():
        if plan.style not in SPLIT_STYLES:
            continue
        if ".lora_" in name and _kv_replicated(name.split(".lora_")[0] + ".base_layer", plan, kv, tp):
            raise NotImplementedError(
                f"{name}: a LoRA adapter on a key/value projection with fewer key/value heads ({kv}) than "
                f"tensor_parallel.size={tp.size} (kept whole on every rank) is not supported yet; leave "
                "k_proj/v_proj out of the LoRA target_modules, or use a TP size that divides the KV heads")
        if _kv_replicated(name, plan, kv, tp):
            if tp.size % kv or not head_dim:
                raise PlanError(
                    f"{name}: the model has {kv} key/value head(s), fewer than tensor_parallel.size={tp.size}, "
                    f"and {tp.size} is not a multiple of {kv}: each rank's query heads must read one whole "
                    f"key/value head. Use a tensor_parallel.size that divides {kv} or is a multiple of it")
            continue
        check_divisible(plan, modules[name], tp, head_dim)
    _refuse_per_head_params(model, plans, modules)
    names_of: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(pname)
    done: dict[int, tuple] = {}  # id(original param) -> (new param, dim, sizes, weakref(original))
    layout = TPLayout(tp, plans, {}, {})

    def done_for(t):
        """The split of ``t`` (an original parameter) made here, if ``t`` is that very tensor:
        ids are addresses, and a tensor made here may reuse a freed original's (the whole
        tensors a meta model is materialised into are freed as soon as they are split)."""
        entry = done.get(id(t))
        return entry if entry is not None and entry[3]() is t else None

    # Largest modules first: materialising a meta model ([Note: materialising a meta model
    # shard by shard] in parallel/materialize.py) then holds one whole large module while few
    # shards exist, and only small ones later (the same order on every rank).
    order = sorted(plans.items(), key=lambda kv: -sum(p.numel() for p in modules[kv[0]].parameters(recurse=False)))
    # A whole parameter's storage is released once every module splitting it has: an
    # optimizer built before prepare() still holds it (until prepare_optimizer gives it the
    # split one), and it would keep the whole model alive meanwhile.
    readers: dict[int, int] = {}
    for name, plan in order:
        if plan.style in SPLIT_STYLES:
            for p in modules[name].parameters(recurse=False):
                readers[id(p)] = readers.get(id(p), 0) + 1
    for name, plan in order:
        module = modules[name]
        if plan.style != "grad_allreduce" and plan.style not in SPLIT_STYLES:
            continue
        if materializer is not None:  # this module whole, right before its split
            for old_id, new in materializer.module(name, module).items():
                names_of[id(new)] = names_of.pop(old_id, [])
                mark(new)  # equal on every rank by construction
        rank0_values(module.parameters(recurse=False))
        if plan.style == "grad_allreduce":
            for p in module.parameters(recurse=False):
                layout.grad_allreduce_ids.add(id(p))
            continue
        if _kv_replicated(name, plan, kv, tp):
            replicate_kv_module(module, plan, tp, head_dim, kv)
            for p in module.parameters(recurse=False):
                layout.grad_allreduce_ids.add(id(p))
            continue
        originals = {"weight": module.weight, "bias": getattr(module, "bias", None)}
        shared = done_for(originals["weight"])
        if shared is not None:
            new_w, dim, sizes, _ = shared
            if (dim, sizes) != (style_dim(plan, module), plan.shape):
                raise PlanError(f"{name}: its weight is shared (tied) with a module split on dim {dim}, but its own "
                                f"plan splits dim {style_dim(plan, module)}; give both the same partition")
        full_shapes = {k: tuple(t.shape) for k, t in originals.items() if isinstance(t, torch.Tensor)}
        for attr, new, dim in split_module(module, plan, tp):
            old = originals[attr]
            if done_for(old) is not None:  # tied: every owner holds the one split parameter
                new = done_for(old)[0]
                setattr(module, attr, new)
            done[id(old)] = (new, dim, plan.shape if attr == "weight" or dim == 0 else None, weakref.ref(old))
            layout.replaced[id(old)] = (weakref.ref(old), new)
            for pname in names_of.get(id(old), []):
                layout.split[pname] = (dim, plan.shape)
                layout.full_shapes[pname] = full_shapes[attr]
            layout.split_ids.add(id(new))
        for old in originals.values():
            if isinstance(old, torch.Tensor) and id(old) in readers:
                readers[id(old)] -= 1
                if readers[id(old)] == 0 and not old.is_meta and done_for(old) is not None:
                    old.data = old.data.new_empty(0)  # split: the whole values are not read again
    # Tied modules elsewhere that still point at an original parameter get the split one.
    for mod in model.modules():
        for attr, p in list(mod._parameters.items()):
            if p is not None and done_for(p) is not None and p is not done_for(p)[0]:
                mod._parameters[attr] = done_for(p)[0]
    if materializer is not None:
        materializer.rest()
        for _, name in materializer.replaced.values():
            mark(model.get_parameter(name))
    rank0_values(p for p in model.parameters() if id(p) not in layout.split_ids)
    trim_heap()  # the whole tensors freed by the splits go back to the OS
    _localise_heads(model, plans, tp, kv)
    _install_split_rng(model, plans, tp)
    for p in model.parameters():
        if id(p) in layout.grad_allreduce_ids and p.requires_grad:
            p.register_hook(_grad_allreduce_hook(tp))
    _install_replica_checks(model, layout, tp)
    _sync_rng(tp)
    _install_input_check(model, tp)
    object.__setattr__(model, "_mixprec_tp_layout", layout)
    return layout


def _column_parents(model: nn.Module, plans: dict[str, LayerPlan], styles: tuple) -> list[nn.Module]:
    """Modules with a child Linear (directly, or as a peft LoRA layer's base) split in one of
    ``styles``: with ``("column",)``, the attention and MLP blocks, whose activations between
    their layers are split (a gathered column output, an lm_head's, is whole again)."""
    out = []
    for name, module in model.named_modules():
        children = [f"{name}.{c}" if name else c for c, _ in module.named_children()]
        children += [f"{c}.base_layer" for c in children]
        if any(plans.get(c) is not None and plans[c].style in styles for c in children):
            out.append(module)
    return out


def _refuse_per_head_params(model: nn.Module, plans: dict[str, LayerPlan], modules: dict) -> None:
    """A module whose heads or features the split divides among the ranks (a parent of
    column-split layers) but which holds its own parameter per head or per feature (Doge's
    ``A`` per key/value head) would combine a whole tensor with this rank's part: refused at
    prepare(), naming it ([Note: split modules keep their forward] in layers.py)."""
    config = getattr(model, "config", None)
    counts = {getattr(config, k, None) for k in ("num_attention_heads", "num_key_value_heads")} - {None}
    for pname, parent in modules.items():
        children = {f"{pname}.{c}" if pname else c: m for c, m in parent.named_children()}
        split_sizes = {m.weight.shape[style_dim(plans[c], m)] for c, m in children.items()
                       if plans.get(c) is not None and plans[c].style == "column"}
        if not split_sizes:
            continue
        for n, t in parent.named_parameters(recurse=False):
            hit = set(t.shape) & (split_sizes | {c for c in counts if isinstance(c, int) and c > 1})
            if hit:
                raise PlanError(
                    f"{pname}.{n}: this {type(parent).__name__} holds a parameter of shape {tuple(t.shape)}, sized like "
                    f"its heads or split features ({sorted(hit)}), which tensor parallelism divides among the ranks; "
                    "its forward would combine the whole parameter with this rank's part. Give its projections "
                    "partition_type: skip in tensor_parallel.partition_config.layer_specs, or train this model "
                    "without tensor parallelism")


def _kv_replicated(name: str, plan: LayerPlan, kv: Optional[int], tp: TPGroup) -> bool:
    """A key/value projection whose heads are fewer than the TP ranks ([Note: KV heads fewer
    than TP ranks] in parallel/tensor/layers.py)."""
    leaf = name.rpartition(".")[2]
    if leaf == "base_layer":
        leaf = name.rsplit(".", 2)[-2]
    return bool(kv) and tp.size > kv and leaf in _KV_NAMES and plan.style == "column" and not plan.shape


def _localise_heads(model: nn.Module, plans: dict[str, LayerPlan], tp: TPGroup, kv: Optional[int]) -> None:
    """A module with a column-split child Linear sees its local head counts; with key/value
    heads fewer than TP ranks, one local key/value head (its query heads' groups adjusted)."""
    kv_whole = bool(kv) and tp.size > kv
    # Only a split output makes a module see its local heads: a gathered one (Phi3's plan
    # gathers its fused qkv) is whole again, and so are its head counts.
    for module in _column_parents(model, plans, ("column",)):
        for attr in _HEAD_ATTRS:
            v = module.__dict__.get(attr)
            if not isinstance(v, int) or isinstance(v, bool):
                continue
            if kv_whole and attr in _KV_ATTRS:
                setattr(module, attr, 1)
            elif v % tp.size == 0:
                setattr(module, attr, v // tp.size)
        groups = module.__dict__.get("num_key_value_groups")
        if kv_whole and isinstance(groups, int):
            heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
            if isinstance(heads, int):
                module.num_key_value_groups = heads // tp.size  # local query heads over 1 kv head


# [Note: dropout under TP]
# Replicated activations (every TP rank computes the same tensor) must draw the same dropout
# mask on every rank: TP ranks run on one RNG stream (_sync_rng). Split activations (an
# attention's heads, an MLP's hidden features) must draw independent masks per rank, as one
# process draws different masks for different heads. The split region of a module whose
# children are split is exactly the stretch from a column child's output to a row child's
# input: its forward runs on its own RNG state from the first column child's output (a seed
# drawn from the shared stream, the same draw on every rank so the shared stream stays in
# step, offset by the TP rank, on a forked generator: torch.random.fork_rng, CPU and the
# current CUDA device) until the next row child's input, or the module's end; the shared state
# is then restored. A dropout after the row layer but inside the same module (GPT-2's
# resid_dropout, its MLP's dropout) so draws on the shared stream, the same mask everywhere.
# The seed comes from the shared stream at each region, so an activation-checkpointing
# recompute (which restores the shared stream) draws the same masks. Only modules with an
# active dropout (training, a Dropout with p > 0 or a positive ``attention_dropout``) fork.
class _SplitRegion:
    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.forks: list = []

    def open(self, child, args, output) -> None:
        if self.forks or not child.training:
            return
        seed = int(torch.randint(0, 2**62, (1,)).item()) + 7919 * self.tp.rank
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        fork = torch.random.fork_rng(devices=devices)
        fork.__enter__()
        self.forks.append(fork)
        torch.manual_seed(seed)

    def close(self, *_args) -> None:
        while self.forks:
            self.forks.pop().__exit__(None, None, None)


def _install_split_rng(model: nn.Module, plans: dict[str, LayerPlan], tp: TPGroup) -> None:
    if tp.size == 1:
        return
    for name, module in model.named_modules():
        if hasattr(module, "base_layer"):  # a peft LoRA layer: its parent holds the region
            continue
        has_dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())
        attn_p = module.__dict__.get("attention_dropout")
        if not has_dropout and not (isinstance(attn_p, float) and attn_p > 0):
            continue
        columns, rows = [], []
        for cname, child in module.named_children():
            path = f"{name}.{cname}" if name else cname
            plan = plans.get(path) or plans.get(f"{path}.base_layer")
            if plan is not None and plan.style == "column":
                columns.append(child)
            elif plan is not None and plan.style in ("row", "row_split_input"):
                rows.append(child)
        if not columns:
            continue
        region = _SplitRegion(tp)
        for child in columns:
            child.register_forward_hook(torch.compiler.disable(region.open))
        for child in rows:
            child.register_forward_pre_hook(torch.compiler.disable(region.close))
        module.register_forward_hook(torch.compiler.disable(region.close), always_call=True)


# [Note: replicated parameters on split activations]
# A parameter the plan leaves whole (replicated) gets the same gradient on every TP rank when
# it computes on replicated activations (a norm before a column layer: [Note: TP collectives
# and their autograd rules] in layers.py). One that computes on split activations, between a
# column and a row layer (Apertus's learnable XIELU activation, a per-head q/k norm no plan
# names), gets on each rank only its heads' or features' part: the whole gradient is their
# sum, and training with one rank's part is silently wrong. Which is which cannot be read off
# the module tree (a peft LoRA's replicated lora_A runs inside a split region on the
# replicated input), so it is measured: until a replicated parameter has had a non-zero
# gradient, a hook compares its gradient's (sum, sum of squares) over the TP group (one
# all-gather of two numbers per parameter, in the first backward, as the gradient arrives).
# Equal on every rank: replicated, decided, the hook is dropped at the next forward. Different:
# the gradient is summed over the TP group from then on, this backward included, as the
# Hugging Face style ``replicated_with_grad_allreduce`` does (a one-line notice names them).
# Gradients agree bitwise across TP ranks on replicated activations (the same inputs, the
# same all-reduced values); the comparison allows 1e-5 relative for kernels that do not.
_REPLICA_RTOL = 1e-5


class _ReplicaCheck:
    def __init__(self, model: nn.Module, layout: TPLayout, tp: TPGroup, names: dict) -> None:
        self.layout, self.tp, self.names = layout, tp, names
        self.handles: dict[int, Any] = {}
        self.decided: list[int] = []  # hooks to drop at the next forward (not inside backward)
        self.partial: list[str] = []
        self.forward_handle = model.register_forward_pre_hook(self._drop_decided)

    def hook_for(self, p: torch.Tensor):
        key = id(p)

        def hook(g: torch.Tensor) -> torch.Tensor:
            if key in self.layout.grad_allreduce_ids:  # decided partial earlier in this backward
                return _sum_over_tp(g, self.tp)
            if key in self.decided:
                return g
            gd = g.detach().double()
            mine = torch.stack([gd.sum(), gd.square().sum()]).to(group_device(self.tp.group))
            parts = [torch.empty_like(mine) for _ in range(self.tp.size)]
            dist.all_gather(parts, mine, group=self.tp.group)
            rows = torch.stack(parts).cpu()
            if not bool(rows[:, 1].gt(0).any()):
                return g  # zero everywhere: undecided, asked again next backward
            self.decided.append(key)
            ref = rows[0]
            same = bool(((rows - ref).abs() <= _REPLICA_RTOL * ref.abs().clamp_min(1e-300)).all())
            if same:
                return g
            self.layout.grad_allreduce_ids.add(key)
            self.partial.append(self.names.get(key, "?"))
            if self.tp.rank == 0 and len(self.partial) == 1:
                import sys

                print("mixprec: tensor parallelism: replicated parameters that compute on split activations "
                      f"(first: {self.partial[0]}) get their gradients summed over the TP group ([Note: "
                      "replicated parameters on split activations] in parallel/tensor/apply.py)",
                      file=sys.stderr, flush=True)
            return _sum_over_tp(g, self.tp)

        return hook

    def _drop_decided(self, module, args) -> None:
        for key in self.decided:
            handle = self.handles.pop(key, None)
            if handle is not None and key not in self.layout.grad_allreduce_ids:
                handle.remove()
        self.decided = [k for k in self.decided if k in self.handles]
        if not self.handles or all(k in self.layout.grad_allreduce_ids for k in self.handles):
            self.forward_handle.remove()


def _install_replica_checks(model: nn.Module, layout: TPLayout, tp: TPGroup) -> None:
    """[Note: replicated parameters on split activations]."""
    if tp.size == 1:
        return
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    checks = _ReplicaCheck(model, layout, tp, names)
    for p in model.parameters():
        key = id(p)
        if not p.requires_grad or key in layout.split_ids or key in layout.grad_allreduce_ids or key in checks.handles:
            continue
        checks.handles[key] = p.register_hook(checks.hook_for(p))
    object.__setattr__(model, "_mixprec_tp_replica_checks", checks)


def _sum_over_tp(g: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    g = g.clone()
    dist.all_reduce(g, group=tp.group)
    return g


def _grad_allreduce_hook(tp: TPGroup):
    def hook(g: torch.Tensor) -> torch.Tensor:
        return _sum_over_tp(g, tp)
    return hook


def _sync_rng(tp: TPGroup) -> None:
    """TP ranks take TP rank 0's torch RNG state (CPU, and the current CUDA device's); the
    states travel on the group's device ([Note: collectives on the group's device] in
    distributed/devices.py: ``get_rng_state()`` is a host tensor, which an NCCL group refuses)."""
    if tp.size == 1:
        return
    src = dist.get_global_rank(tp.group, 0)
    device = group_device(tp.group)
    state = torch.get_rng_state().to(device)
    dist.broadcast(state, src=src, group=tp.group)
    torch.set_rng_state(state.cpu())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda_state = torch.cuda.get_rng_state().to(device)
        dist.broadcast(cuda_state, src=src, group=tp.group)
        torch.cuda.set_rng_state(cuda_state.cpu())


def _digest(args: tuple, kwargs: dict) -> torch.Tensor:
    """A cheap fingerprint of the tensor inputs (shapes and a float64 sum of each)."""
    h = hashlib.sha256()
    sums = []
    for v in list(args) + [kwargs[k] for k in sorted(kwargs)]:
        if isinstance(v, torch.Tensor):
            h.update(str((tuple(v.shape), str(v.dtype))).encode())
            sums.append(v.detach().double().sum().reshape(1).cpu() if v.numel() else torch.zeros(1, dtype=torch.float64))
    head = int.from_bytes(h.digest()[:6], "little")
    total = torch.cat(sums).sum() if sums else torch.zeros((), dtype=torch.float64)
    return torch.stack([torch.tensor(float(head), dtype=torch.float64), total.reshape(())])


def _install_input_check(model: nn.Module, tp: TPGroup) -> None:
    """At the first forward, the TP ranks compare their inputs' fingerprints (one all-gather
    of two numbers): different batches on ranks that split one model are an error naming
    them (DeepSpeed's first-batch check), not silently wrong gradients."""
    if tp.size == 1:
        return
    handle = None

    @torch.compiler.disable
    def check(module, args, kwargs):
        handle.remove()
        mine = _digest(args, kwargs)
        device = group_device(tp.group)
        parts = [torch.empty(2, dtype=torch.float64, device=device) for _ in range(tp.size)]
        dist.all_gather(parts, mine.to(device), group=tp.group)
        rows = [p.cpu() for p in parts]
        if any(not torch.equal(rows[0], r) for r in rows[1:]):
            ranks = [dist.get_global_rank(tp.group, i) for i in range(tp.size)]
            raise InputMismatchError(
                f"the ranks {ranks} of one tensor-parallel group got different inputs at the first forward "
                f"(fingerprints {[tuple(r.tolist()) for r in rows]}). TP ranks split one model and must see the "
                "same batch: prepare the DataLoader with accelerator.prepare() (it shards over the data-parallel "
                "ranks only), or give every rank of a TP group the same data")
        return None

    handle = model.register_forward_pre_hook(check, with_kwargs=True)
