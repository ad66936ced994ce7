"""Which weights tensor parallelism splits, and how: the plan.

[Note: plan resolution]
For every ``nn.Linear``, transformers ``Conv1D`` (GPT-2's transposed Linear) and
``nn.Embedding`` of the model, the first of these that names it decides, in DeepSpeed
AutoTP's order:

1. ``tensor_parallel.partition_config.layer_specs``: the first spec whose ``model_types``
   admits the model's ``config.model_type`` and one of whose ``patterns`` (regexes) is found
   in the module's path (``model.layers.0.self_attn.q_proj``; a pattern written for the
   parameter, ending in ``.weight`` or ``.weight$``, matches its module too);
2. unless ``use_default_specs`` is false: the model's Hugging Face plan (``model.tp_plan``,
   else ``_tp_plan`` plus ``config.base_model_tp_plan`` under the base model's prefix;
   ``*`` in a key stands for a layer index);
3. the preset ``tensor_parallel.preset_model``, or the one named like ``config.model_type``
   (parallel/tensor/presets.py);
4. name heuristics (presets.HEURISTICS), applied only to a parent module that has both a
   column and a row candidate among its Linears, so that a row-split layer always reads a
   column-split one's output.

Anything none of them names is replicated. What mixprec cannot apply is an error at
``prepare()``, never a silent skip: a Hugging Face style it does not implement, a plan key
naming a parameter or a module of another type, a layer spec that matches no module, and
a ``tensor_parallel.size`` above 1 whose plan splits nothing (the error lists the sources
tried).

Styles (``LayerPlan.style``):
- ``column``: weight ``[out, in]`` and bias split on ``out``; the input is replicated, the
  output stays split on its last dimension (Hugging Face ``colwise``);
- ``column_gather``: ``column``, the output gathered (``colwise_rep``,
  ``colwise_gather_output``; e.g. an ``lm_head`` whose logits the loss reads whole);
- ``row``: weight split on ``in``; the input is split on its last dimension, the output is
  summed over the TP group and the bias added once (``rowwise``);
- ``row_split_input``: ``row`` taking a replicated input and using its own slice
  (``rowwise_rep``, ``rowwise_split_input``);
- ``vocab``: an ``nn.Embedding`` split on the vocabulary; each rank looks up the ids it
  holds, the rest read zeros, and the lookups are summed (``embedding_rowwise``);
- ``embedding_col``: an ``nn.Embedding`` split on the hidden dimension, the lookups
  gathered (``embedding_colwise``);
- ``grad_allreduce``: replicated, its gradient summed over the TP group (a norm between a
  column and a row layer that sees only this rank's heads: ``replicated_with_grad_allreduce``);
- ``replicated``: left whole on every rank.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

from torch import nn

from .presets import HEURISTICS, PRESETS


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _linear_like(module: nn.Module) -> bool:
    """A Linear, a transformers Conv1D, or a peft LoRA layer around either."""
    base = getattr(module, "base_layer", None)
    return any(isinstance(m, nn.Linear) or _is_conv1d(m) for m in (module, base) if m is not None)

# Hugging Face style -> mixprec style (and the module type it applies to).
HF_STYLES: dict[str, tuple[str, type]] = {
    "colwise": ("column", nn.Linear),
    "colwise_rep": ("column_gather", nn.Linear),
    "colwise_gather_output": ("column_gather", nn.Linear),
    "rowwise": ("row", nn.Linear),
    "rowwise_rep": ("row_split_input", nn.Linear),
    "rowwise_split_input": ("row_split_input", nn.Linear),
    "packed_colwise": ("column", nn.Linear),  # two packed halves (gate_up): split each
    "packed_rowwise": ("row", nn.Linear),
    "embedding_rowwise": ("vocab", nn.Embedding),
    "embedding_colwise": ("embedding_col", nn.Embedding),
    "replicated_with_grad_allreduce": ("grad_allreduce", nn.Module),
    "replicate": ("replicated", nn.Module),
}
SPLIT_STYLES = ("column", "column_gather", "row", "row_split_input", "vocab", "embedding_col")
_SPEC_STYLES = {"column": "column", "row": "row", "skip": "replicated"}


class PlanError(ValueError):
    """A tensor-parallel plan that cannot be applied (unknown style, wrong module, sizes)."""


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """How one module is split: ``style`` (see the module docstring), ``source`` (which step
    of [Note: plan resolution] chose it), ``shape``: the sub-parameters of a fused weight
    along the split dimension (sizes resolved to ints, or None: one parameter)."""

    name: str
    style: str
    source: str
    shape: Optional[tuple] = None
    dim: Optional[int] = None  # the weight dimension split (None: the style's own)

    def split_dim(self) -> Optional[int]:
        if self.style not in SPLIT_STYLES:
            return None
        if self.dim is not None:
            return self.dim
        return {"column": 0, "column_gather": 0, "row": 1, "row_split_input": 1, "vocab": 0,
                "embedding_col": 1}[self.style]

    def describe(self) -> str:
        if self.style == "replicated":
            return "replicated"
        d = self.split_dim()
        where = f" dim {d}" if d is not None else ""
        sub = f", sub-parameters {list(self.shape)}" if self.shape else ""
        return f"{self.style}{where}{sub} ({self.source})"


def _get(obj: Any, key: str, default=None):
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def hf_plan(model: nn.Module) -> dict[str, str]:
    """The model's Hugging Face tensor-parallel plan, keys as full module paths (``*`` = a
    layer index); empty when it has none."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    out: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = _get(config, "base_model_tp_plan") or {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = getattr(model, prefix, None) if prefix else None
    for key, style in base.items():
        out[f"{prefix}.{key}" if isinstance(inner, nn.Module) else key] = style
    for key, style in (getattr(type(model), "_tp_plan", None) or {}).items():
        out[key] = style
    return out


def _key_regex(key: str) -> re.Pattern:
    return re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")


def _model_type(model: nn.Module) -> Optional[str]:
    return _get(getattr(model, "config", None), "model_type")


def _shape_sizes(shape: Any, size: int, model: nn.Module, name: str) -> Optional[tuple]:
    """A spec's ``shape`` (DeepSpeed notation) as the sizes of the sub-parameters along the
    split dimension. ``[[q, kv, kv], -1]`` or ``[2, -1]`` (split dim first), ``("q", "kv",
    "kv")`` or ``2`` (presets): names resolve from the config, an int k is k equal parts."""
    if shape is None:
        return None
    first = shape
    if isinstance(shape, (list, tuple)) and len(shape) >= 1 and (
            isinstance(shape[0], (list, tuple)) or (len(shape) > 1 and shape[-1] == -1)):
        first = shape[0]
    if isinstance(first, int):
        if first <= 0 or size % first:
            raise PlanError(f"{name}: shape {shape!r} asks for {first} equal sub-parameters of a dimension of "
                            f"size {size}; use a count that divides {size}")
        return (size // first,) * first
    config = getattr(model, "config", None)
    heads = _get(config, "num_attention_heads")
    kv_heads = _get(config, "num_key_value_heads") or _get(config, "multi_query_group_num") or heads
    head_dim = _get(config, "head_dim") or (
        _get(config, "hidden_size") // heads if heads and _get(config, "hidden_size") else None)
    names = {"q": heads * head_dim if heads and head_dim else None,
             "kv": kv_heads * head_dim if kv_heads and head_dim else None}
    sizes = []
    for s in first:
        if isinstance(s, str):
            if names.get(s) is None:
                raise PlanError(f"{name}: shape {shape!r} names {s!r}, but the model's config gives no "
                                "num_attention_heads/num_key_value_heads/head_dim to size it; write the sizes as ints")
            sizes.append(names[s])
        elif isinstance(s, int) and s > 0:
            sizes.append(s)
        else:
            raise PlanError(f"{name}: shape {shape!r} has the entry {s!r}; sub-parameter sizes are ints > 0")
    if sum(sizes) != size:
        raise PlanError(f"{name}: shape {shape!r} gives sub-parameters {sizes} summing to {sum(sizes)}, but the "
                        f"split dimension has size {size}; fix the sizes")
    return tuple(sizes)


def _spec_matches(spec: Any, name: str, model_type: Optional[str]) -> bool:
    types = tuple(_get(spec, "model_types", ()) or ())
    if types and model_type not in types:
        return False
    for pat in _get(spec, "patterns", ()) or ():
        for candidate in (name, name + ".weight"):
            if re.search(pat, candidate):
                return True
    return False


def resolve_plan(model: nn.Module, tp_config: Any) -> dict[str, LayerPlan]:
    """The plan of every ``nn.Linear``/``nn.Embedding`` of ``model`` ([Note: plan resolution]):
    module path -> LayerPlan (``replicated`` where nothing splits it).

    A peft model is planned on its base model (the Hugging Face plan's keys are relative to
    it) and every LoRA layer is expanded ([Note: LoRA under TP])."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    if base is not model:
        prefix = next(n for n, m in model.named_modules() if m is base)
        inner = _resolve(base, tp_config)
        return {f"{prefix}.{k}" if prefix else k: dataclasses.replace(v, name=f"{prefix}.{k}" if prefix else k)
                for k, v in inner.items()}
    return _resolve(model, tp_config)


# [Note: LoRA under TP]
# A peft LoRA layer wraps the Linear the plan names (``q_proj`` -> ``q_proj.base_layer``) and
# adds ``lora_B(lora_A(x))`` to its output. The adapter must produce the base layer's layout:
# - base column-split (output split): ``lora_B`` is column-split the same way (its input, the
#   rank-r activation, goes through copy_to, so its gradient, and with it ``lora_A``'s and
#   x's, is summed over the TP ranks); ``lora_A`` stays replicated;
# - base row-split (input split, output summed): ``lora_A`` is row-split (its partial
#   products summed over TP); ``lora_B`` stays replicated and adds to the summed output.
# So a LoRA's trainable matrices follow the same rules as any Linear, and the norm, the
# checkpoints and the exports need nothing of their own.
def _expand_lora(plans: dict[str, LayerPlan], modules: dict[str, nn.Module]) -> dict[str, LayerPlan]:
    out = {}
    for name, plan in plans.items():
        module = modules[name]
        base = getattr(module, "base_layer", None)
        if not isinstance(base, nn.Linear) or plan.style not in SPLIT_STYLES:
            out[name] = plan
            continue
        out[f"{name}.base_layer"] = dataclasses.replace(plan, name=f"{name}.base_layer")
        column = plan.style.startswith("column")
        if column and plan.shape:
            raise PlanError(f"{name}: a LoRA adapter on a fused weight split into sub-parameters {list(plan.shape)} "
                            "is not supported; put the adapter on unfused Linears, or give this module "
                            "partition_type: skip")
        for adapters, follows in (("lora_A", not column), ("lora_B", column)):
            for key, sub in getattr(module, adapters, {}).items():
                path = f"{name}.{adapters}.{key}"
                if isinstance(sub, nn.Linear):
                    style = plan.style if follows else "replicated"
                    out[path] = LayerPlan(path, style, f"{plan.source}+lora")
    return out


def _resolve(model: nn.Module, tp_config: Any) -> dict[str, LayerPlan]:
    partition = _get(tp_config, "partition_config")
    specs = list(_get(partition, "layer_specs", ()) or ())
    use_defaults = bool(_get(partition, "use_default_specs", True))
    model_type = _model_type(model)
    preset_name = _get(tp_config, "preset_model") or (model_type if model_type in PRESETS else None)
    if preset_name is not None and preset_name not in PRESETS:
        raise PlanError(f"tensor_parallel.preset_model={preset_name!r} is not a preset; use one of "
                        f"{sorted(PRESETS)} or a partition_config")
    hf = [(key, _key_regex(key), style) for key, style in hf_plan(model).items()] if use_defaults else []
    preset = PRESETS.get(preset_name, []) if use_defaults else []
    modules = dict(model.named_modules())
    plans: dict[str, LayerPlan] = {}

    def weight_size(module: nn.Module, style: str, dim: Optional[int]) -> int:
        m = getattr(module, "base_layer", module)  # a peft LoRA layer: its base Linear
        out_dim, in_dim = (1, 0) if _is_conv1d(m) else (0, 1)  # Conv1D's weight is [in, out]
        d = dim if dim is not None else {"column": out_dim, "row": in_dim}.get(style, 0)
        return m.weight.shape[d]

    used_specs: set = set()

    # 1. partition_config specs, 2. the HF plan (any module type it names), 3. the preset.
    for name, module in modules.items():
        if not name:
            continue
        is_linear, is_embedding = _linear_like(module), isinstance(module, nn.Embedding)
        spec = next((s for s in specs if _spec_matches(s, name, model_type)), None)
        if spec is not None and (is_linear or is_embedding):
            used_specs.add(id(spec))
            style = _SPEC_STYLES.get(_get(spec, "partition_type"))
            if style is None:
                raise PlanError(f"{name}: partition_type {_get(spec, 'partition_type')!r}; use column, row or skip")
            if is_embedding and style != "replicated":
                style = "vocab" if style == "row" or _get(spec, "partition_dim") == 0 else "embedding_col"
            dim = _get(spec, "partition_dim")
            shape = None
            if style in ("column", "row"):
                shape = _shape_sizes(_get(spec, "shape"), weight_size(module, style, dim), model, name)
            plans[name] = LayerPlan(name, style, "partition_config", shape, dim)
            continue
        entry = next(((k, s) for k, rx, s in hf if rx.match(name)), None)
        if entry is not None:
            key, hf_style = entry
            if hf_style not in HF_STYLES:
                raise PlanError(
                    f"{name}: the model's Hugging Face tp_plan gives it the style {hf_style!r} (key {key!r}), "
                    f"which mixprec does not implement (supported: {sorted(HF_STYLES)}). Give this module a "
                    "tensor_parallel.partition_config layer spec (partition_type column, row or skip), or set "
                    "use_default_specs: false and write the plan as layer_specs")
            style, kind = HF_STYLES[hf_style]
            ok = _linear_like(module) if kind is nn.Linear else (
                isinstance(module, kind) or isinstance(getattr(module, "base_layer", None), kind))
            if not ok:
                raise PlanError(f"{name}: the Hugging Face style {hf_style!r} applies to {kind.__name__}, but this "
                                f"module is a {type(module).__name__}; override it with a partition_config layer spec")
            shape = None
            if hf_style.startswith("packed_"):
                shape = _shape_sizes(2, weight_size(module, style, None), model, name)
            plans[name] = LayerPlan(name, style, "hf_plan", shape)
            continue
        if not is_linear:
            continue
        rule = next(((p, t, s) for p, t, s in preset if re.search(p, name)), None)
        if rule is not None:
            style = _SPEC_STYLES[rule[1]]
            shape = _shape_sizes(rule[2], weight_size(module, style, None), model, name) if style != "replicated" else None
            plans[name] = LayerPlan(name, style, f"preset:{preset_name}", shape)
    _check_unused(specs, used_specs, hf, modules, dict(model.named_parameters()), model_type)
    # 4. heuristics, per parent with both a column and a row candidate.
    if use_defaults and not any(p.source in ("hf_plan",) or p.source.startswith("preset") for p in plans.values()):
        by_parent: dict[str, dict[str, str]] = {}
        for name, module in modules.items():
            linear = _linear_like(module)
            if not name or name in plans or not linear or ".lora_" in name or name.endswith(".base_layer"):
                continue
            rule = next((t for p, t, _ in HEURISTICS if re.search(p, name)), None)
            if rule is not None:
                by_parent.setdefault(name.rpartition(".")[0], {})[name] = rule
        for parent, named in by_parent.items():
            if {"column", "row"} <= set(named.values()):
                for name, style in named.items():
                    plans[name] = LayerPlan(name, style, "heuristic")
    plans = _expand_lora(plans, modules)
    for name, module in modules.items():
        if name and name not in plans and (isinstance(module, (nn.Linear, nn.Embedding)) or _is_conv1d(module)):
            plans[name] = LayerPlan(name, "replicated", "default")
    return plans


def _check_unused(specs: list, used: set, hf: list, modules: dict, params: dict, model_type: Optional[str]) -> None:
    """A layer spec that matches no module, or a Hugging Face plan key that names a
    parameter or matches nothing a style applies to, is an error (never a silent skip)."""
    for i, spec in enumerate(specs):
        types = tuple(_get(spec, "model_types", ()) or ())
        if id(spec) in used or (types and model_type not in types):
            continue
        raise PlanError(
            f"tensor_parallel.partition_config.layer_specs[{i}] (patterns {list(_get(spec, 'patterns', ()) or ())}) "
            "matches no Linear, Conv1D or Embedding module of the model; module paths look like "
            f"{[n for n, m in modules.items() if _linear_like(m)][:3]}: fix the pattern or remove the spec")
    for key, rx, style in hf:
        if any(rx.match(n) for n in modules if n):
            continue
        hit = next((n for n in params if rx.match(n)), None)
        if hit is not None:
            raise PlanError(
                f"the model's Hugging Face tp_plan gives the parameter {hit!r} (key {key!r}) the style {style!r}: "
                "mixprec splits modules (Linear, Conv1D, Embedding), not bare parameters such as fused MoE "
                "experts. Give the model's modules a tensor_parallel.partition_config (partition_type column, row "
                "or skip, use_default_specs: false), or train it without tensor parallelism")


def nothing_split_message(model: nn.Module, tp_config: Any, size: int) -> str:
    """The error for a ``tensor_parallel.size`` above 1 whose plan splits nothing."""
    partition = _get(tp_config, "partition_config")
    specs = list(_get(partition, "layer_specs", ()) or ())
    use_defaults = bool(_get(partition, "use_default_specs", True))
    model_type = _model_type(model)
    tried = [f"partition_config.layer_specs: {len(specs)} spec(s)"]
    if use_defaults:
        tried.append("the Hugging Face tp_plan: " + ("none" if not hf_plan(model) else "keys matched no module"))
        preset = _get(tp_config, "preset_model") or model_type
        tried.append(f"preset: {'none for model_type ' + repr(model_type) if preset not in PRESETS else preset}")
        tried.append("name heuristics: no module holding both a column Linear (q_proj, wq, fc1, w1, c_fc...) and a "
                     "row Linear (o_proj, wo, fc2, w2...)")
    else:
        tried.append("use_default_specs: false (no Hugging Face plan, preset or heuristics)")
    return (f"tensor_parallel.size={size}, but no module of {type(model).__name__} is split: tried "
            + "; ".join(tried) + ". Every rank would do the whole work. Write a tensor_parallel.partition_config "
            f"(layer_specs with patterns, partition_type column/row; presets: {sorted(PRESETS)}), or set "
            "tensor_parallel.size: 1")
