"""Tensor parallelism (AutoTP): what ``Accelerator`` calls (docs/tensor_parallel.md).

- :func:`setup`: at ``Accelerator(...)``: the mesh and the DP group the engine reduces over;
- :func:`prepare_model`: at ``prepare()``: the plan applied, the engine given the
  placements (which parameters are split, [Note: agreement over the mesh]);
- :func:`full_state_dict`: split tensors made whole (``get_state_dict``, ``save_model``,
  ``save_16bit_model``).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from ..mesh import Mesh, MeshError, build_mesh
from .apply import InputMismatchError, TPLayout, apply_tensor_parallel
from .engine import TPPlacement
from .layers import TPGroup, copy_to, gather_from, reduce_from, scatter_to
from .plan import LayerPlan, PlanError, resolve_plan

__all__ = ["InputMismatchError", "LayerPlan", "Mesh", "MeshError", "PlanError", "TPGroup", "TPLayout",
           "TPPlacement", "attach", "copy_to", "full_state_dict", "gather_from", "layout_of", "prepare_model", "reduce_from",
           "resolve_plan", "scatter_to", "setup", "swap_optimizer_params"]

def setup(comm_cls: type, state: Any, tp_size: int, mesh: Optional[Mesh] = None) -> Mesh:
    """The mesh for ``tensor_parallel.size = tp_size`` (a collective).
    Every distributed backend composes: ddp/zero1/zero2 replicate or shard the split model's
    state over the DP group, zero3/fsdp shard its units over it (the 2-D layout)."""
    from ..mesh import check_layout

    check_layout(state.world_size, tp_size, mesh.sp_size if mesh is not None else 1)
    if not comm_cls.distributed:
        raise MeshError(f"tensor_parallel.size={tp_size} needs several processes and a distributed backend, "
                        f"got backend={comm_cls.name!r}; use ddp, zero1, zero2, zero3 or fsdp (or auto)")
    if mesh is None:
        mesh = build_mesh(state.world_size, state.rank, tp_size, backend=state.backend)
    return mesh


def tp_group(mesh: Mesh) -> TPGroup:
    return TPGroup(mesh.tp_group, mesh.tp_size, mesh.tp_rank)


def prepare_model(model: nn.Module, engine: Any, mesh: Mesh, tp_config: Any, world_group: Any) -> TPLayout:
    """Split ``model`` by its plan and tell the engine's comm which parameters are split."""
    tp = tp_group(mesh)
    layout = apply_tensor_parallel(model, tp_config, tp, world_group=world_group, device=engine.device)
    attach(engine, layout, world_group.group_name)
    return layout


def attach(engine: Any, layout: TPLayout, world_group_name: str) -> None:
    """Tell ``engine`` which parameters ``layout`` split (its placements)."""
    if engine.placement is None:
        engine.placement = TPPlacement(layout.tp, world_group_name, layout.split_ids)
    else:
        engine.placement.add(layout.split_ids)


def swap_optimizer_params(optimizer: Any, models: list) -> None:
    """An optimizer built from the model's parameters before ``prepare()`` holds the ones
    prepare() replaced: meta parameters materialised ([Note: materialising a meta model
    shard by shard] in parallel/materialize.py), whole ones tensor parallelism split. Give
    it the replacements (as Accelerate does for FSDP2)."""
    from ..materialize import MATERIALIZED_ATTR

    layouts = [lay for lay in map(layout_of, models) if lay is not None]

    def replacement(p):
        for model in models:
            entry = model.__dict__.get(MATERIALIZED_ATTR, {}).get(id(p))
            if entry is not None and entry[0]() is p:  # ids are addresses: the very tensor
                return model.get_parameter(entry[1])  # what prepare() left under its name
        split = next((r for lay in layouts if (r := lay.replacement(p)) is not None), None)
        return split if split is not None else p

    stale = [p for g in optimizer.param_groups for p in g["params"] if replacement(p) is not p and p in optimizer.state]
    if stale:
        raise ValueError(f"{type(optimizer).__name__} already holds state for {len(stale)} parameter(s) that prepare() "
                         "replaced (materialised or split); prepare the model and the optimizer before the first "
                         "optimizer step")
    for group in optimizer.param_groups:
        group["params"] = [replacement(p) for p in group["params"]]


def layout_of(model: nn.Module) -> Optional[TPLayout]:
    return model.__dict__.get("_mixprec_tp_layout")


def full_state_dict(model: nn.Module, state: dict) -> dict:
    """``state`` with the split tensors of ``model`` made whole (a TP collective)."""
    layout = layout_of(model)
    return state if layout is None else layout.full_state_dict(state)
