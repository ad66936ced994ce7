"""``mixprec config explain``'s precision table is computed from facts the engine classes
declare (``owns_masters``, ``shards_parameters``, ``distributed``, ``run_policy`` on each
Comm class in src/mixprec/engines), not from a hand-kept copy. These tests build every
backend on one process (a distributed backend over a one-process gloo group, as the
Accelerator makes it), run a forward and backward through a small model, and check that

- each declared fact matches what the built engine does, and
- the row ``explain`` prints for the backend is the row read off the built engine (stored
  parameter dtype and sharding, the forward's compute dtype, the dtype gradients are
  reduced in, the dtype of the gradients the optimizer steps, what the optimizer steps,
  the loss scaler the engine runs);

so a fact that drifts from its engine, or an explain row that drifts from its facts, fails.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import Accelerator
from mixprec.config.explain import BACKENDS, policy_of, precision_row
from mixprec.config.fields import format_value
from mixprec.config.resolve import engine_kwargs, resolve
from mixprec.engines import ENGINES
from mixprec.engines.zero import DEEPSPEED_SCALER
from mixprec.policy import dtype_name
from _helpers import END_AFTER_TEST

_LOW = (torch.bfloat16, torch.float16)

# Configs whose rows differ in every column, each fact taking both of its values.
CONFIGS = {
    # fsdp adopts its param_dtype option (mixed_precision='bf16' keeps the model's dtype).
    "bf16": {"mixed_precision": "bf16", "fsdp": {"param_dtype": "bf16"}},
    # zero's loss_scaler='deepspeed' replaces the scaler; fsdp's reduce_dtype is the wire dtype.
    "fp16": {"mixed_precision": "fp16", "zero1": {"loss_scaler": "deepspeed"},
             "zero3": {"loss_scaler": "deepspeed"}, "fsdp": {"reduce_dtype": "bf16"}},
    # bf16 storage with fp32 masters on the replicated backends.
    "bf16-params": {"mixed_precision": "bf16", "param_dtype": "bf16"},
    # no masters: the replicated backends update bf16 weights; the sharded ones refuse.
    "bf16-pure": {"mixed_precision": "bf16-pure"},
}
# Each config on the backends where its row says something new (every backend: bf16, and
# bf16-pure, where the sharded ones refuse before building anything).
_SKIP = {"fp16": ("zero2",), "bf16-params": ("zero1", "zero2", "fsdp")}
CASES = [(c, b) for c in CONFIGS for b in BACKENDS if b not in _SKIP.get(c, ())]

_MADE = END_AFTER_TEST  # ended after each test by tests/conftest.py


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _build(config: dict):
    """An Accelerator for ``config``, a prepared model and AdamW, after one forward and
    backward; the dtype of the first Linear's output in that forward."""
    acc = Accelerator(config=config, device=torch.device("cpu"), log_policy=False)
    _MADE.append(acc)
    model = _model()
    computed = []
    model[0].register_forward_hook(lambda m, i, out: computed.append(out.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    acc.backward(model(torch.randn(4, 8)).float().square().mean())
    acc.engine.comm.fold()  # every gradient the optimizer steps is current
    return acc, model, optimizer, computed[0]


def _observed(acc, model, optimizer, computed) -> dict:
    """What the built engine does, read off its objects (no declared fact used)."""
    comm, precision = acc.engine.comm, acc.engine.precision
    stepped = [p for g in optimizer.optimizer.param_groups for p in g["params"]]
    model_ids = {id(p) for p in model.parameters()}
    master_ids = {id(m) for m in precision.master_of.values()}
    stored = {p.dtype for p in model.parameters()}
    assert len(stored) == 1
    stored = stored.pop()
    options = getattr(comm, "options", None)  # the C++ sharding cores' options
    seen = {
        "distributed": getattr(comm, "group", None) is not None,
        # the optimizer steps tensors that are neither the model's nor the precision layer's
        "owns_masters": not any(id(p) in model_ids or id(p) in master_ids for p in stepped),
        "shards_parameters": bool(options is not None and options.shard_params),
    }
    params = "as given" if stored == torch.float32 else dtype_name(stored)
    if seen["shards_parameters"]:
        params += ", 1/N shard (gathered per unit)"
    if not seen["distributed"]:
        reduce = "- (one process)"
    elif options is not None:
        assert all(c.master_shard.dtype == torch.float32 for c in comm.all_cores())
        reduce = f"{dtype_name(options.reduce_dtype)} (reduce-scatter into fp32 shards)"
    else:  # ddp: the dtype its Reducer was given
        reduce = dtype_name(comm.policy.reduce_dtype)
    grads = {p.grad.dtype for p in stepped if p.grad is not None}
    assert len(grads) == 1, grads
    if seen["owns_masters"]:
        assert all(p.dtype == torch.float32 for p in stepped)
        masters = "fp32, 1/N shard"
    elif all(id(p) in model_ids for p in stepped) and stored in _LOW:
        masters = "none (low-precision weights updated in place)"
    elif all(id(p) in master_ids and p.dtype == torch.float32 for p in stepped):
        masters = "fp32"
    else:
        assert stored == torch.float32 and all(id(p) in model_ids for p in stepped)
        masters = "fp32 params (+ fp32 masters for bf16/fp16 params)"
    scaling = "off"
    if precision.scaler is not None:
        o = precision.scaler.options  # what the C++ scaler runs
        ds = DEEPSPEED_SCALER
        kind = "deepspeed" if (o.init_scale, o.growth_interval, o.hysteresis, o.min_scale) == (
            ds.init_scale, ds.growth_interval, ds.hysteresis, ds.min_scale) else "torch"
        scaling = (f"dynamic, {kind} (init {format_value(o.init_scale)}, grow every "
                   f"{o.growth_interval}, hysteresis {o.hysteresis})")
    seen["row"] = (comm.name, params, dtype_name(computed), reduce, dtype_name(grads.pop()), masters, scaling)
    return seen


@pytest.mark.parametrize("name, backend", CASES, ids=[f"{c}-{b}" for c, b in CASES])
def test_explain_row_is_what_the_built_engine_does(name, backend):
    config = {**CONFIGS[name], "backend": backend}
    cfg = resolve(config, env={}).config
    policy, options, comm_class = policy_of(cfg), engine_kwargs(cfg, backend), ENGINES[backend]
    row = precision_row(backend, policy, cfg)
    if row[1].startswith(("not supported", "error")):
        with pytest.raises(ValueError) as refused:
            _build(config)
        if row[1].startswith("not supported"):
            assert comm_class.owns_masters and "keeps fp32 master shards" in str(refused.value)
        else:
            assert row[1] == f"error: {refused.value}"
        return
    acc, model, optimizer, computed = _build(config)
    comm = acc.engine.comm
    assert type(comm) is comm_class
    seen = _observed(acc, model, optimizer, computed)
    for fact in ("distributed", "owns_masters", "shards_parameters"):
        assert getattr(comm_class, fact) == seen[fact], (
            f"{comm_class.__name__}.{fact} = {getattr(comm_class, fact)}, but the built {backend} engine "
            f"does {'' if seen[fact] else 'not '}{fact.replace('_', ' ')}")
    assert comm_class.run_policy(policy, **options) == comm.policy, (
        f"{comm_class.__name__}.run_policy disagrees with the policy its __init__ made")
    assert row == seen["row"], f"explain says {row}, the built {backend} engine does {seen['row']}"


def test_fsdp_option_conflict_is_the_engines_error():
    config = {"backend": "fsdp", "mixed_precision": "bf16", "fsdp": {"output_dtype": "bf16"}}
    row = precision_row("fsdp", policy_of(resolve(config, env={}).config), resolve(config, env={}).config)
    with pytest.raises(ValueError) as refused:
        _build(config)
    assert row[1] == f"error: {refused.value}"
