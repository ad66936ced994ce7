"""The suite's one judge of fp32 training results that differ from a reference by rounding.

[Note: calibrated bounds]
Two fp32 runs of the same training that sum in different orders (one process against TP or
SP slices, compiled against eager, micro-batches against one batch) differ by rounding, and
Adam amplifies it where a gradient element is near ``eps``. How much depends on the CPU's
kernels (MKL's and oneDNN's blockings, AVX2 or AVX-512 or AMX, inductor's fusions), so no
element-wise constant is right on every machine: 1e-5 between compiled and eager passed on
an AMD EPYC and failed on a Sapphire Rapids Xeon at 1.5e-5 (issue #46). A result is judged
instead by how far it is from the same training in float64, against how far fp32 runs of
that training are on this very machine:

- ``ref64``: the training in float64 (the same fp32-initialised model converted, the same
  batches);
- ``spread``: fp32 runs of the same training that sum in other orders (at least the plain
  one-process run; the model matrix adds two micro-batches and every Linear in the blocks of
  a 2-way split, test_model_matrix._blocks_class). Their farthest distance from ``ref64`` is
  what rounding alone does here.

``excess`` is the larger of two ratios, and at most 1.0 passes:

- whole model: the norm of all differences from ``ref64`` over the farthest spread run's,
  bound ``NORM_BOUND`` (2x): a stable figure;
- worst tensor: the largest norm-wise relative difference ``||a - ref|| / ||ref||`` of any
  tensor over the largest of any spread run's, bound ``WORST_BOUND`` (3x: two independent
  roundings' worst cases differ more). Norm-wise, not element-wise: one element that Adam
  moved by ``lr`` because its gradient sign was decided by rounding (a fact of every run,
  and which element it is, is chance) weighs by its share of the tensor, not as the tensor.
  Tensors that start at exactly zero (biases) are left out of this ratio, not out of the
  whole-model one: their values are nothing but such steps ([Note: the matrix's bound]).

The negative control is part of every verdict: ``planted_escapes`` scales each judged tensor
of the result in turn by (1 + 1e-3), a 0.1% error in one tensor, and lists the tensors where
that would still pass. A test asserts both ``excess <= 1`` and that nothing escapes, so a
bound that the spread of a machine made too loose to see a 0.1% error fails there too,
instead of passing silently.
"""

from __future__ import annotations

NORM_BOUND, WORST_BOUND = 2.0, 3.0
PLANTED = 1e-3  # the error a verdict must see: 0.1% in any one judged tensor


def _d(a, b) -> float:
    return float((a.double() - b.double()).norm())


def _rel(a, b) -> float:
    return _d(a, b) / max(float(b.double().norm()), 1e-300)


def zero_init(state: dict) -> set:
    """The floating-point tensors of ``state`` (a fresh model's) that are exactly zero."""
    return {k for k, v in state.items() if v.is_floating_point() and not bool(v.any())}


class Judge:
    """Judges fp32 results of one training against ``ref64`` and its fp32 ``spread``
    ([Note: calibrated bounds]); ``keys`` are the tensors compared (default: all floating
    point ones of ``ref64``), ``zero`` those left out of the worst-tensor ratio."""

    def __init__(self, ref64: dict, spread: list, keys=None, zero=frozenset()) -> None:
        if not spread:
            raise ValueError("a Judge needs at least one fp32 run in `spread`")
        self.ref64 = ref64
        self.keys = [k for k in (keys if keys is not None else ref64) if ref64[k].is_floating_point()]
        self.judged = [k for k in self.keys if k not in zero] or list(self.keys)
        self.norm_scale = max(self._norm(s) for s in spread)
        self.worst_scale = max(_rel(s[k], ref64[k]) for s in spread for k in self.judged)

    def _norm(self, state: dict) -> float:
        return sum(_d(state[k], self.ref64[k]) ** 2 for k in self.keys) ** 0.5

    def excess(self, got: dict) -> tuple[float, str]:
        """(excess, worst tensor): at most 1.0 passes."""
        norm_ratio = self._norm(got) / max(self.norm_scale, 1e-300)
        worst, key = max((_rel(got[k], self.ref64[k]), k) for k in self.judged)
        worst_ratio = worst / max(self.worst_scale, 1e-300)
        return max(norm_ratio / NORM_BOUND, worst_ratio / WORST_BOUND), key

    def planted_escapes(self, got: dict) -> list:
        """The judged tensors where a 0.1% error planted in ``got`` would still pass (should
        be none). Computed from the norms, as ``excess`` of each planted copy would be."""
        base = {k: _d(got[k], self.ref64[k]) for k in self.keys}
        total2 = sum(v * v for v in base.values())
        rels = {j: _rel(got[j], self.ref64[j]) for j in self.judged}  # once, not once per planted tensor
        escapes = []
        for k in self.judged:
            planted = got[k].double() * (1 + PLANTED)
            d = float((planted - self.ref64[k].double()).norm())
            norm_ratio = max(total2 - base[k] ** 2 + d * d, 0.0) ** 0.5 / max(self.norm_scale, 1e-300)
            worst = max([d / max(float(self.ref64[k].double().norm()), 1e-300)]
                        + [r for j, r in rels.items() if j != k])
            if max(norm_ratio / NORM_BOUND, worst / max(self.worst_scale, 1e-300) / WORST_BOUND) <= 1.0:
                escapes.append(k)
        return escapes

    def verdict(self, got: dict) -> dict:
        """Everything a test asserts: ``excess`` (<= 1.0), its ``tensor``, ``escapes`` ([]);
        ``norm``/``worst``: the two ratios before their bounds (for the record)."""
        excess, key = self.excess(got)
        worst = max(_rel(got[k], self.ref64[k]) for k in self.judged)
        return {"excess": excess, "tensor": key, "escapes": self.planted_escapes(got),
                "norm": self._norm(got) / max(self.norm_scale, 1e-300), "worst": worst / max(self.worst_scale, 1e-300)}


def assert_verdict(v: dict, context=None) -> None:
    """``v`` from :meth:`Judge.verdict` passes and its negative control fails."""
    assert v["excess"] <= 1.0, (context, v["excess"], v["tensor"])
    assert not v["escapes"], (context, "a 0.1% error in these tensors would pass", v["escapes"])


# ----------------------------------------------------------------- the runs a Judge needs
def block_sums():
    """A TorchFunctionMode computing every ``F.linear`` with even feature counts in four
    blocks: each half of the output features as the sum of the products of the two halves
    of the input features. Forward sums in the order of a 2-way split of the input features,
    backward sums the input's gradient over the two halves of the output features: the
    orders of a 2-way tensor-parallel split, in one process."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class Blocks(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.linear:
                x, w = args[0], args[1]
                b = args[2] if len(args) > 2 else kwargs.get("bias")
                n, k = w.shape
                if k % 2 == 0 and n % 2 == 0:
                    h, m = k // 2, n // 2
                    y = torch.cat([F.linear(x[..., :h], w[r:r + m, :h]) + F.linear(x[..., h:], w[r:r + m, h:])
                                   for r in (0, m)], dim=-1)
                    return y if b is None else y + b
            return func(*args, **kwargs)

    return Blocks


SPREAD = ("f32", "micro", "blocks")  # the fp32 runs of a training that sum in other orders


def hf_loss(model, ids):
    """The loss of a transformers causal LM on ``ids`` (labels = inputs)."""
    return model(input_ids=ids, labels=ids).loss


def reference_run(build, batches, variant: str, *, lr: float = 1e-3, eps: float = 1e-8, clip=None,
                  loss=hf_loss, trainable=None, lr_lambda=None, weight_decay: float = 0.01) -> dict:
    """Plain PyTorch AdamW training of ``build()`` over ``batches`` in one process, as
    ``variant``: ``f64`` (the model converted to float64, floating inputs too), ``f32``,
    ``micro`` (each batch as two equal halves whose gradients add up: the halves' mean loss
    equals the whole batch's when the halves hold equal numbers of tokens) or ``blocks``
    (every Linear summed as a 2-way split, :func:`block_sums`). ``clip``: the max norm of
    ``clip_grad_norm_``; ``trainable(model)``: the parameters to train (default: all);
    ``lr_lambda``: a ``LambdaLR`` schedule stepped after every optimizer step.
    Returns {"state", "norms" (pre-clip gradient norms), "losses"}."""
    import contextlib

    import torch

    if variant not in ("f64", *SPREAD):
        raise ValueError(f"variant={variant!r}: use 'f64' or one of {SPREAD}")
    model = build()
    if variant == "f64":
        model = model.double()

    def cast(batch):
        if isinstance(batch, (tuple, list)):
            return type(batch)(cast(b) for b in batch)
        return batch.double() if variant == "f64" and batch.is_floating_point() else batch

    params = [p for p in (trainable(model) if trainable is not None else model.parameters())]
    opt = torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda is not None else None
    norms, losses = [], []
    for batch in batches:
        batch = cast(batch)
        if variant == "micro":
            total = 0.0
            for half in zip(*(b.chunk(2) for b in batch)) if isinstance(batch, tuple) else batch.chunk(2):
                part = loss(model, half) / 2
                part.backward()
                total += float(part.detach())
            losses.append(total)
        else:
            with block_sums()() if variant == "blocks" else contextlib.nullcontext():
                value = loss(model, batch)
            value.backward()
            losses.append(float(value.detach()))
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": norms,
            "losses": losses}


def shared_runs(run, variants) -> dict:
    """{variant: run(variant)}. Inside an initialised process group the variants are split
    between the ranks and the results all-gathered (every rank must call this at the same
    point, as every collective), so N ranks pay for a reference once, not N times."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {v: run(v) for v in variants}
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {v: run(v) for i, v in enumerate(variants) if i % world == rank}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return {v: r for part in everyone for v, r in part.items()}


def judge_runs(build, batches, keys=None, exclude=(), **kw) -> tuple:
    """(Judge, float64 run, fp32 runs) of one training ([Note: calibrated bounds]): the
    float64 run, the fp32 ``SPREAD`` runs, tensors zero at the start out of the worst-tensor
    ratio; ``exclude``: name suffixes compared nowhere (a key bias: softmax ignores it, so
    its gradient is rounding noise in every run). ``kw`` go to :func:`reference_run`. The
    runs are shared between the ranks of an initialised group (:func:`shared_runs`)."""
    runs = shared_runs(lambda v: reference_run(build, batches, v, **kw), ("f64", *SPREAD))
    ref64, spread = runs["f64"], [runs[v] for v in SPREAD]
    keys = [k for k in (keys if keys is not None else ref64["state"]) if not k.endswith(tuple(exclude))]
    zero = zero_init(build().state_dict())
    return Judge(ref64["state"], [s["state"] for s in spread], keys, zero), ref64, spread


def scalar_excess(got: list, ref64: list, spread: list) -> float:
    """Per-step scalars (losses, gradient norms) of a run against the float64 run's, over
    the farthest fp32 spread run's (bound ``WORST_BOUND``, floor 16 fp32 ulps of the value:
    where every fp32 run lands within a few ulps, two ulps apart is not an error); at most
    1.0 passes. A 0.1% error planted in any one step's value must exceed it (asserted here:
    the negative control of every call)."""
    def err(seq):
        return max(abs(a - b) / max(abs(b), 1e-300) for a, b in zip(seq, ref64))

    scale = max(max(err(s) for s in spread), 16 * 2.0 ** -24)
    # The negative control: a 0.1% error planted in any one step's value must exceed the bound.
    for i in range(len(got)):
        planted = list(got)
        planted[i] = got[i] * (1 + PLANTED)
        assert err(planted) > WORST_BOUND * scale, (
            f"a 0.1% error in step {i}'s value would pass: the fp32 spread here ({scale:.3g}) is too wide to judge")
    return err(got) / (WORST_BOUND * scale)
