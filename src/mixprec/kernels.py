"""Multi-tensor kernels of mixprec and their use as a fused optimizer step.

The compiled kernels live in ``mixprec._C``; this module gives them typed
signatures and plugs the fused Adam/AdamW/SGD kernels into plain
``torch.optim`` optimizers (:func:`fused_optimizer_step`), keeping the
optimizer's own state format so ``state_dict()`` stays interchangeable with
plain torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import weakref
from typing import Optional

import torch
from torch import Tensor

from . import _C

__all__ = [
    "unscale_and_check_",
    "l2_norm",
    "fused_adam_",
    "fused_sgd_",
    "copy_cast_",
    "scale_copy_and_check_",
    "flat_copy_in_",
    "flat_copy_out_",
    "supports_fused",
    "step_plan",
    "forget_plan",
    "fused_optimizer_step",
]


def unscale_and_check_(tensors: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_`` in one pass (bitwise equal)."""
    _C.unscale_and_check_(list(tensors), found_inf, inv_scale)


def l2_norm(tensors: Sequence[Tensor], found_inf: Optional[Tensor] = None) -> Tensor:
    """Global L2 norm (fp32 0-dim); sets ``found_inf`` to 1.0 when it is not finite."""
    return _C.l2_norm(list(tensors), found_inf)


def unscale_and_check_any_(tensors: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """:func:`unscale_and_check_` for gradients of any layout: a non-contiguous one (a param
    whose ``.data`` was given another layout) goes to torch's op, which takes any layout
    and is bitwise the same."""
    tensors = list(tensors)
    if all(t.is_contiguous() for t in tensors):
        _C.unscale_and_check_(tensors, found_inf, inv_scale)
        return
    _C.unscale_and_check_([t for t in tensors if t.is_contiguous()], found_inf, inv_scale)
    torch._amp_foreach_non_finite_check_and_unscale_([t for t in tensors if not t.is_contiguous()],
                                                      found_inf, inv_scale)


def l2_norm_any(tensors: Sequence[Tensor], found_inf: Optional[Tensor] = None) -> Tensor:
    """:func:`l2_norm` for tensors of any layout (a non-contiguous one is read through a
    contiguous copy)."""
    return _C.l2_norm([t if t.is_contiguous() else t.contiguous() for t in tensors], found_inf)


def fused_adam_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    lowp_params: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    decoupled: bool,
    maximize: bool,
    inv_scale: Optional[Tensor],
    found_inf: Optional[Tensor],
) -> None:
    """One Adam (``decoupled=False``) / AdamW step; ``step`` is already incremented."""
    _C.fused_adam_(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                   list(lowp_params), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                   weight_decay=weight_decay, step=step, decoupled=decoupled,
                   maximize=maximize, inv_scale=inv_scale, found_inf=found_inf)


def fused_sgd_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    lowp_params: Sequence[Tensor],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    first_step: bool,
    inv_scale: Optional[Tensor],
    found_inf: Optional[Tensor],
) -> None:
    """One ``torch.optim.SGD`` step; buffers are set to the grad when ``first_step``."""
    _C.fused_sgd_(list(params), list(grads), list(momentum_buffers), list(lowp_params), lr=lr,
                  momentum=momentum, dampening=dampening, nesterov=nesterov,
                  weight_decay=weight_decay, maximize=maximize, first_step=first_step,
                  inv_scale=inv_scale, found_inf=found_inf)


def copy_cast_(dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for every i in one pass (round to nearest-even)."""
    _C.copy_cast_(list(dsts), list(srcs))


def scale_copy_and_check_(dsts: Sequence[Tensor], srcs: Sequence[Tensor], found_inf: Tensor,
                          scale: Tensor) -> None:
    """``dsts[i] = srcs[i] * scale`` (same dtypes; in place allowed) in one pass, setting
    ``found_inf`` to 1.0 when a source element is inf/nan (the ddp Reducer's copy-in)."""
    _C.scale_copy_and_check_(list(dsts), list(srcs), found_inf, scale)


def flat_copy_in_(flat: Tensor, srcs: Sequence[Tensor]) -> None:
    """Pack ``srcs`` back to back into the 1-D buffer ``flat`` (cast to its dtype)."""
    _C.flat_copy_in_(flat, list(srcs))


def flat_copy_out_(dsts: Sequence[Tensor], flat: Tensor) -> None:
    """Split the 1-D buffer ``flat`` into ``dsts`` (cast to their dtypes)."""
    _C.flat_copy_out_(list(dsts), flat)


# ---- optimizer integration ----------------------------------------------------

_ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW)
FUSED_TYPES = (*_ADAM_TYPES, torch.optim.SGD)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _group_flags_ok(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    if group.get("capturable", False) or group.get("differentiable", False):
        return False
    return not (type(optimizer) in _ADAM_TYPES and group.get("amsgrad", False))


def _group_supported(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Every param and gradient of ``group`` fits the kernels (a scan: plan builds only)."""
    if not _group_flags_ok(optimizer, group):
        return False
    f32 = torch.float32
    for p in group["params"]:
        if p.dtype != f32 or not p.is_contiguous():  # fp32: never complex
            return False
        g = p.grad
        if g is not None and (g.is_sparse or g.dtype not in _KERNEL_DTYPES):
            return False
    return True


# [Note: the step plan] (csrc/engines/step/optimizer_plan.h) is what a step hands to C++:
# built once per optimizer, it holds every param, its state tensors and low-precision
# target. Python keeps it while the objects it was built from are the same: the
# optimizer's param_groups list and each group's params list (same object, same length),
# its state dict (same object, same number of entries: a param's first state adds one),
# and the low-precision target mapping (same object, same length). Checking that is
# O(param groups) per step. An edit inside those containers at the same size (a list item
# replaced, ``optimizer.state[p] = {}``, ``optimizer.state[p]["exp_avg"] = t``) is seen by
# C++: the plan's ``PlanSource`` records every item's identity at build time and the step
# and the clip compare them before using the plan ([Note: the plan's sources] in
# csrc/bindings/step.cpp); a difference makes Python rebuild the plan. mixprec's checkpoint
# loads drop the plan themselves (``forget_plan``; engines/base.py, ``load_state_shards``).
# Per step C++ reads the gradients itself and checks that each param and gradient still
# fits the kernels; one that does not sends the step to the optimizer's own code, the
# kernels having done nothing.

_NOTHING = object()


class _Planned:
    """One optimizer's eligibility and plan, with the objects they were built from (held,
    so that an identity check cannot be fooled by a reused id)."""

    __slots__ = ("groups", "params", "lens", "state", "n_state", "eligible", "lowp_of", "n_lowp", "plan", "source")

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.groups = optimizer.param_groups
        self.params = [g["params"] for g in self.groups]
        self.lens = [len(ps) for ps in self.params]
        self.state = optimizer.state
        self.n_state = len(self.state)
        self.eligible = all(_group_supported(optimizer, g) for g in self.groups)
        self.lowp_of: object = _NOTHING
        self.n_lowp = 0
        self.plan: Optional[_C.OptimizerPlan] = None
        self.source: Optional[_C.PlanSource] = None  # [Note: the plan's sources] (csrc/bindings/step.cpp)

    def current(self, optimizer: torch.optim.Optimizer) -> bool:
        groups = optimizer.param_groups
        if groups is not self.groups or optimizer.state is not self.state or len(self.state) != self.n_state \
                or len(groups) != len(self.params):
            return False
        for g, ps, n in zip(groups, self.params, self.lens):
            if g["params"] is not ps or len(ps) != n:
                return False
        return True


_PLANS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Planned]" = weakref.WeakKeyDictionary()


def _planned(optimizer: torch.optim.Optimizer) -> Optional[_Planned]:
    """The optimizer's current :class:`_Planned` (None: not a type the kernels step, or a
    group flag they do not take). O(param groups) when nothing changed."""
    if type(optimizer) not in FUSED_TYPES:
        return None
    for g in optimizer.param_groups:
        if not _group_flags_ok(optimizer, g):
            return None
    planned = _PLANS.get(optimizer)
    if planned is None or not planned.current(optimizer):
        planned = _PLANS[optimizer] = _Planned(optimizer)
    return planned


_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def drop_grads(optimizer: torch.optim.Optimizer) -> bool:
    """``optimizer.zero_grad(set_to_none=True)`` for an optimizer the kernels step with
    torch's own ``zero_grad``: every param's ``.grad = None``, from the lists the plan
    holds. False (nothing done): another optimizer, or a ``zero_grad`` of its own.

    Why not torch's loop: it asks ``p.grad is not None`` first, which makes a Python object
    for each gradient that only C++ touched this step (the fused clip and step read them
    there): about 3 us per parameter, most of ``zero_grad``. Setting ``.grad`` needs no
    object for the old value."""
    if type(optimizer).zero_grad is not _TORCH_ZERO_GRAD:
        return False
    planned = _planned(optimizer)
    if planned is None:
        return False
    for params in planned.params:
        for p in params:
            p.grad = None
    return True


def forget_plan(optimizer: torch.optim.Optimizer) -> None:
    """Drop ``optimizer``'s step plan: its state tensors were replaced in place (the next
    step builds a new plan)."""
    _PLANS.pop(optimizer, None)


def supports_fused(optimizer: torch.optim.Optimizer) -> bool:
    """True when :func:`fused_optimizer_step` can step this optimizer.

    Exactly ``torch.optim.Adam``, ``AdamW`` or ``SGD`` (subclasses may change the
    update), fp32 dense contiguous params, and no amsgrad / capturable /
    differentiable. The ``foreach`` and ``fused`` flags do not matter. Cached with the
    step plan: O(param groups) per call ([Note: the step plan]).
    """
    planned = _planned(optimizer)
    return planned is not None and planned.eligible


def _scalar(x) -> float:
    # torch's single-tensor path turns tensor hyper-parameters into Python
    # numbers through .item() as well (Adam with a tensor lr: see the tests).
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def _state_ok(state: dict, keys: Sequence[str], p: Tensor) -> bool:
    for k in keys:
        t = state.get(k)
        if t is not None and not (t.dtype == torch.float32 and t.is_contiguous()
                                  and t.device == p.device and t.shape == p.shape):
            return False
    return True


def _with_grad(optimizer, keys) -> Optional[list]:
    """[(group, params with a grad)], or None when some state tensor does not fit."""
    out = []
    state = optimizer.state
    for group in optimizer.param_groups:
        ps = [p for p in group["params"] if p.grad is not None]
        for p in ps:
            st = state.get(p)
            if st and not _state_ok(st, keys, p):
                return None
        out.append((group, ps))
    return out


def _buckets(keys: list, lists: Sequence[list]) -> dict:
    """[Note: buckets] one kernel call per distinct key (device, has-lowp; SGD
    also first-step). The common case, one key for the whole group, builds no
    per-param dict."""
    first = keys[0]
    if all(k == first for k in keys):
        return {first: lists}
    out: dict = {}
    for i, k in enumerate(keys):
        b = out.get(k)
        if b is None:
            b = out[k] = tuple([] for _ in lists)
        for dst, src in zip(b, lists):
            if src:
                dst.append(src[i])
    return out


def _lowps(lowp_of: Optional[Mapping[int, Tensor]], ps: list) -> list:
    if lowp_of is None:
        return [None] * len(ps)
    get = lowp_of.get
    return [get(id(p)) for p in ps]


def _device_step(st: dict, p: Tensor) -> None:
    # [Note: device step counters]
    # Each param's "step" is an fp32 0-dim tensor on the param's device, as in torch's
    # fused Adam. The kernel increments it and derives the bias corrections from it, and
    # leaves it alone when found_inf is set: a skipped step needs no host read. (torch's
    # default CPU-resident counters would force the host to know the outcome first.)
    step = st["step"]
    if not (isinstance(step, Tensor) and step.dtype == torch.float32
            and step.device == p.device and step.numel() == 1):
        # A counter loaded from torch's layout (CPU) or a number: moved once.
        st["step"] = torch.as_tensor(step, dtype=torch.float32).to(p.device).reshape(())


def _adam_options(optimizer, group) -> tuple:
    # The tuple _C.fused_step reads per group of a plan (csrc/bindings/step.cpp, adam_options).
    decoupled = bool(group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW))
    beta1, beta2 = group["betas"]
    return (_scalar(group["lr"]), _scalar(beta1), _scalar(beta2), float(group["eps"]),
            float(group["weight_decay"]), decoupled, bool(group["maximize"]))


def _sgd_options(group) -> tuple:
    # csrc/bindings/step.cpp, sgd_options
    return (_scalar(group["lr"]), float(group["momentum"]), float(group["dampening"]),
            bool(group["nesterov"]), float(group["weight_decay"]), bool(group["maximize"]))


def _adam_groups(optimizer, lowp_of) -> Optional[list]:
    """The kernel groups of a step without a plan (one that creates optimizer state)."""
    groups = _with_grad(optimizer, ("exp_avg", "exp_avg_sq"))
    if groups is None:
        return None
    state = optimizer.state
    out = []
    for group, ps in groups:
        if not ps:
            continue
        sts = [state[p] for p in ps]
        for p, st in zip(ps, sts):
            if len(st) == 0:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            else:
                _device_step(st, p)
        lps = _lowps(lowp_of, ps)
        keys = [(p.device, lp is not None) for p, lp in zip(ps, lps)]
        lists = (ps, [p.grad.contiguous() for p in ps], [st["exp_avg"] for st in sts],
                 [st["exp_avg_sq"] for st in sts], lps, [st["step"] for st in sts])
        hyper = _adam_options(optimizer, group)
        for (_, has_lp), (bps, gs, ms, vs, blps, steps) in _buckets(keys, lists).items():
            # The tuple layout _C.fused_step reads (csrc/bindings/step.cpp, adam_groups).
            out.append((bps, gs, ms, vs, blps if has_lp else [], [t.view(1) for t in steps], *hyper))
    return out


def _sgd_groups(optimizer, lowp_of) -> Optional[list]:
    groups = _with_grad(optimizer, ("momentum_buffer",))
    if groups is None:
        return None
    state = optimizer.state
    out = []
    for group, ps in groups:
        if not ps:
            continue
        momentum = float(group["momentum"])
        bufs: list = []
        firsts = [False] * len(ps)
        if momentum != 0:
            for i, p in enumerate(ps):
                st = state[p]
                buf = st.get("momentum_buffer")
                if buf is None:
                    buf = torch.empty_like(p, memory_format=torch.contiguous_format)
                    firsts[i] = True
                    st["momentum_buffer"] = buf
                bufs.append(buf)
        lps = _lowps(lowp_of, ps)
        keys = [(f, p.device, lp is not None) for f, p, lp in zip(firsts, ps, lps)]
        lists = (ps, [p.grad.contiguous() for p in ps], bufs, lps)
        for (first, _, has_lp), (bps, gs, bbufs, blps) in _buckets(keys, lists).items():
            # The tuple layout _C.fused_step reads (csrc/bindings/step.cpp, sgd_groups).
            out.append((bps, gs, bbufs, blps if has_lp else [], _scalar(group["lr"]), momentum,
                        float(group["dampening"]), bool(group["nesterov"]),
                        float(group["weight_decay"]), bool(group["maximize"]), first))
    return out


def _build_plan(optimizer, lowp_of: Optional[Mapping[int, Tensor]]) -> Optional[_C.OptimizerPlan]:
    """The plan of [Note: the step plan]: every param (with or without a gradient) in
    param-group order, its state tensors (None where it has none yet), its low-precision
    target, bucketed by (group, device, has-target). None when a state tensor or a target
    does not fit the kernels (the generic step then runs)."""
    adam = type(optimizer) is not torch.optim.SGD
    keys = ("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer",)
    state = optimizer.state
    buckets = []
    for gi, group in enumerate(optimizer.param_groups):
        ps = group["params"]
        if not ps:
            continue
        s1, s2, steps = [], [], []
        for p in ps:
            if p.dtype != torch.float32 or not p.is_contiguous():
                return None  # changed since eligibility was decided (model.to(channels_last)...)
            st = state.get(p)
            if not st or st.get(keys[0]) is None:
                s1.append(None), s2.append(None), steps.append(None)
                continue
            if not _state_ok(st, keys, p):
                return None
            if adam:
                if st.get("exp_avg_sq") is None or "step" not in st:
                    return None
                _device_step(st, p)
                s1.append(st["exp_avg"]), s2.append(st["exp_avg_sq"]), steps.append(st["step"].view(1))
            else:
                s1.append(st["momentum_buffer"])
        lps = _lowps(lowp_of, ps)
        for lp in lps:
            if lp is not None and (lp.dtype not in (torch.bfloat16, torch.float16) or not lp.is_contiguous()):
                return None
        lists = (ps, s1, s2, steps, lps)
        for (_, has_lp), (bps, b1, b2, bsteps, blps) in _buckets(
                [(p.device, lp is not None) for p, lp in zip(ps, lps)], lists).items():
            buckets.append((gi, bps, b1, b2 if adam else [], bsteps if adam else [], blps if has_lp else []))
    return _C.OptimizerPlan(adam, buckets)


def step_plan(optimizer: torch.optim.Optimizer,
              lowp_of: Optional[Mapping[int, Tensor]] = None) -> Optional[_C.OptimizerPlan]:
    """``optimizer``'s step plan for these low-precision targets ([Note: the step plan]),
    built on first use and kept while nothing it was built from changed; None when the
    fused kernels cannot step this optimizer."""
    planned = _planned(optimizer)
    if planned is None or not planned.eligible:
        return None
    if not lowp_of:
        lowp_of = None  # an empty mapping (made anew per call by some engines) is none
    if planned.lowp_of is not lowp_of or (lowp_of is not None and len(lowp_of) != planned.n_lowp):
        planned.plan = _build_plan(optimizer, lowp_of)
        # After the build (it may turn a float step into a tensor): what the plan was built from.
        planned.source = None if planned.plan is None else _C.PlanSource(
            [g["params"] for g in optimizer.param_groups], optimizer.state)
        planned.lowp_of = lowp_of
        planned.n_lowp = 0 if lowp_of is None else len(lowp_of)
    return planned.plan


def plan_source(optimizer: torch.optim.Optimizer) -> Optional[_C.PlanSource]:
    """The :class:`_C.PlanSource` of ``optimizer``'s current plan (None: no plan)."""
    planned = _PLANS.get(optimizer)
    return None if planned is None else planned.source


class StalePlan(Exception):
    """A step plan no longer matches its optimizer's containers, or the clip's params hold a
    gradient the plans do not ([Note: the plan's sources]): nothing was computed."""


def plans_l2_norm(plans: Sequence[_C.OptimizerPlan], found_inf: Optional[Tensor] = None,
                  sources: Sequence[Optional[_C.PlanSource]] = (), outsiders: tuple = ()) -> Optional[Tensor]:
    """:func:`l2_norm` over the gradients the step ``plans`` hold (one C++ call; None when
    none holds a gradient). Raises :class:`StalePlan` when a plan's ``sources`` changed or
    one of ``outsiders`` holds a gradient."""
    status, norm = _C.plans_l2_norm(list(plans), found_inf, list(sources), outsiders)
    if status != _DONE:
        raise StalePlan(status)
    return norm


def _options(optimizer) -> list:
    if type(optimizer) is torch.optim.SGD:
        return [_sgd_options(g) for g in optimizer.param_groups]
    return [_adam_options(optimizer, g) for g in optimizer.param_groups]


def _on(t: Optional[Tensor], like: Tensor) -> Optional[Tensor]:
    # A view when already fp32 on that device: the kernel must read (and for found_inf,
    # see) the engine's own flag, not a copy.
    return None if t is None else t.to(device=like.device, dtype=torch.float32).reshape(1)


_DONE, _DECLINED, _NEEDS_STATE, _STALE = 0, 1, 2, 3  # what _C.fused_step returns with a plan


@torch.no_grad()
def fused_optimizer_step(
    optimizer: torch.optim.Optimizer,
    *,
    lowp_of: Optional[Mapping[int, Tensor]] = None,
    inv_scale: Optional[Tensor] = None,
    found_inf: Optional[Tensor] = None,
    **finish,
) -> bool:
    """Step ``optimizer`` with the fused kernels; False (nothing done) if unsupported.

    ``lowp_of`` maps ``id(param)`` to a bf16/fp16 tensor that receives the
    updated param in the same pass. Grads are multiplied by ``inv_scale`` inside
    the update when given. When ``found_inf`` is nonzero the kernels skip the step
    entirely (state, step counters and params untouched), decided on the device:
    nothing here reads ``found_inf`` ([Note: device step counters]), except on a
    step that creates optimizer state (the plan reports it, [Note: the step plan]). ``finish``: the rest
    of the step that runs in the same call (``check``, ``check_inv_scale``,
    ``agree_group``, ``gather``, ``scaler``, ``keep_found_inf``, ``keep_scale``; see
    [Note: one call per step] in csrc/engines/step/fused_step.h): one crossing into
    C++ per step. Python's work is O(param groups) once the optimizer has state
    ([Note: the step plan]).
    """
    found = _on(found_inf, found_inf)
    scale = _on(inv_scale, inv_scale)
    for _ in range(2):
        plan = step_plan(optimizer, lowp_of)
        if plan is None:
            return False
        status = _C.fused_step(plan=plan, options=_options(optimizer), source=plan_source(optimizer),
                               found_inf=found, grad_scale=scale, **finish)
        if status != _STALE:
            break
        # A list item or state entry was replaced in place ([Note: the plan's sources]):
        # nothing was done; the plan is rebuilt from the containers as they are now.
        forget_plan(optimizer)
    if status == _DONE:
        return True
    if status in (_DECLINED, _STALE):  # _STALE twice: containers changing under us, torch's step
        forget_plan(optimizer)  # rebuilt (and checked again) at the next step
        return False
    # _NEEDS_STATE: the step that creates some param's state, as torch does it.
    forget_plan(optimizer)
    if finish:
        # It reads found_inf on the host: the caller checks, agrees and finishes around a
        # call without ``finish`` (engines/base.py falls back to that path on False).
        return False
    if found_inf is not None:
        if float(found_inf.item()) != 0.0:
            # The first step of a param creates its state (and SGD's first step differs): it
            # must know it is not skipped, so that a skipped first step leaves no state, as
            # torch's. One host read on such steps only; every later step reads nothing.
            return True
    sgd = type(optimizer) is torch.optim.SGD
    for group in optimizer.param_groups:
        if not _group_supported(optimizer, group):
            return False
    groups = _sgd_groups(optimizer, lowp_of) if sgd else _adam_groups(optimizer, lowp_of)
    if groups is None:
        return False
    _C.fused_step(adam=[] if sgd else groups, sgd=groups if sgd else [], found_inf=found, grad_scale=scale,
                  **finish)
    return True
