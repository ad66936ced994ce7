"""fp16 matmuls on a CPU without fp16 arithmetic, computed by the fp32 GEMM.

[Note: fp16 GEMMs on a CPU without fp16 arithmetic]
Under ``mixed_precision="fp16"`` on a CPU, autocast runs every ``F.linear`` / ``matmul`` /
``mm`` / ``bmm`` / ``addmm`` in fp16. Where the CPU has fp16 arithmetic (AVX512-FP16, AMX-FP16) torch
hands them to oneDNN; elsewhere (every AMD CPU so far, Intel before Sapphire Rapids, most
laptops) it runs ATen's portable fp16 GEMM, which accumulates in fp32 and rounds the result
to fp16 once, 10 to 25 times slower than the fp32 GEMM on the same shapes (a
4096x1024 weight gradient from 512 rows: 538 ms against 21 ms on a 2-core AMD EPYC).

Same numbers, from the fast GEMM: an fp16 value widens to fp32 exactly, so
``round_fp16(fp32_gemm(widen(a), widen(b)))`` is the portable kernel's computation, with the
fp32 sums taken in the BLAS's order instead of the portable loop's. That is the difference
between any two fp32 GEMMs, and the result stays one fp16 rounding of an fp32 sum. The
backward does the same for each gradient (``grad_a = round(widen(g) @ widen(b)^T)`` ...),
so every tensor the graph holds and returns has the dtype autocast gives it: fp16
activations, fp16 gradients of the casts, fp32 gradients of fp32 weights.

How: the prepared model's forward runs inside :class:`HalfGemmMode`, a
``TorchFunctionMode`` that sees the matmul family while autocast is on for the CPU with
fp16. It casts the operands as autocast would (fp32 -> fp16, one cast per weight per forward,
as autocast's cast cache), then calls :class:`_WidenedGemm`, which keeps the fp16 inputs
for backward (no fp32 copy is saved). Anything else goes on unchanged: other ops, tensor
subclasses, fp64 or non-CPU operands, products smaller than ``MIN_WORK`` multiply-adds (a
Python autograd node costs more than the portable kernel there), a forward that
``torch.compile`` traces, and ``torch.func`` transforms (vmap, grad). Products outside the
prepared model's forward (a loss head computed in the loop) keep torch's kernels.

Config ``cpu_fp16_matmul``: ``auto`` (on exactly when the CPU lacks fp16 arithmetic),
``fp32`` (always), ``native`` (off: torch's own kernels).
"""

from __future__ import annotations

import functools
import platform
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

MIN_WORK = 1 << 18  # multiply-adds below which the portable kernel is left to run

_F16 = torch.float16
_F32 = torch.float32


@functools.lru_cache(maxsize=None)
def cpu_has_fp16_arithmetic() -> bool:
    """True when torch's CPU fp16 GEMM is oneDNN's (AVX512-FP16 or AMX-FP16 on x86), or the
    machine is not x86 (ARM's fp16 paths are left to torch)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return True
    if getattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)():
        return True
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512_fp16" in line.split()
    except OSError:
        pass
    return False  # not Linux, x86: assume the portable kernel (the widened GEMM is right either way)


def wanted(setting: str) -> bool:
    """Whether config ``cpu_fp16_matmul`` = ``setting`` turns the widened GEMMs on here."""
    if setting == "fp32":
        return True
    if setting == "native":
        return False
    if setting == "auto":
        return not cpu_has_fp16_arithmetic()
    raise ValueError(f"cpu_fp16_matmul={setting!r}: expected 'auto', 'fp32' or 'native'")


def describe(setting: str = "auto") -> str:
    """The fp16 matmul path ``cpu_fp16_matmul`` = ``setting`` takes on this CPU, and why
    (``mixprec env``, ``mixprec config explain``)."""
    native = cpu_has_fp16_arithmetic()
    why = ("the CPU has fp16 arithmetic (AVX512-FP16/AMX-FP16: torch's fp16 GEMM is oneDNN's)" if native else
           "the CPU has no fp16 arithmetic (torch's fp16 GEMM is the portable loop)")
    path = "fp32 (fp32 GEMMs of the fp16 inputs, rounded to fp16)" if wanted(setting) else "native (torch's fp16 GEMM)"
    return f"{path}: {setting!r}; {why}" if setting == "auto" else f"{path}: set to {setting!r}; {why}"


def _round(t: torch.Tensor) -> torch.Tensor:
    return t.to(_F16)


class _WidenedGemm(torch.autograd.Function):
    """``kind`` of fp16 ``a``, ``b`` (``bias``) computed as the fp32 GEMM, rounded to fp16."""

    @staticmethod
    def forward(ctx, kind: str, a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.kind = kind
        ctx.has_bias = bias is not None
        ctx.bias_dim = None if bias is None else bias.dim()
        ctx.save_for_backward(a, b)
        return _round(_gemm(kind, a.to(_F32), b.to(_F32), None if bias is None else bias.to(_F32)))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Ordinary differentiable ops: under create_graph (a gradient penalty) autograd
        # records them, so a second backward goes through the same widened products.
        a, b = ctx.saved_tensors
        need_a, need_b, need_bias = ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        ga = gb = gbias = None
        with torch.autocast("cpu", enabled=False):
            g = grad.to(_F32)
            kind = ctx.kind
            if kind == "linear":  # out = a @ b^T + bias; a (..., k), b (n, k)
                if need_a:
                    ga = _round(g @ b.to(_F32))
                if need_b or need_bias:
                    g2 = g.reshape(-1, g.shape[-1])
                    if need_b:
                        gb = _round(g2.t() @ a.reshape(-1, a.shape[-1]).to(_F32))
                    if need_bias and ctx.has_bias:
                        gbias = _round(g2.sum(0))
            elif kind == "addmm":  # out = bias + a @ b; a (m, k), b (k, n), bias (n,) or (m, n)
                if need_a:
                    ga = _round(g @ b.to(_F32).t())
                if need_b:
                    gb = _round(a.to(_F32).t() @ g)
                if need_bias and ctx.has_bias:
                    gbias = _round(g.sum(0) if ctx.bias_dim == 1 else g)
            elif kind == "matmul2":  # out = a @ b; a (..., k), b (k, n)
                if need_a:
                    ga = _round(g @ b.to(_F32).t())
                if need_b:
                    gb = _round(a.reshape(-1, a.shape[-1]).to(_F32).t() @ g.reshape(-1, g.shape[-1]))
            else:  # "bmm": a (B, m, k), b (B, k, n)
                if need_a:
                    ga = _round(torch.bmm(g, b.to(_F32).transpose(1, 2)))
                if need_b:
                    gb = _round(torch.bmm(a.to(_F32).transpose(1, 2), g))
        return None, ga, gb, gbias


def _gemm(kind: str, a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cpu", enabled=False):
        if kind == "linear":
            return torch.nn.functional.linear(a, b, bias)
        if kind == "matmul2":
            return a @ b
        if kind == "addmm":
            return torch.addmm(bias, a, b)
        return torch.bmm(a, b)


_LINEAR = {torch.nn.functional.linear, torch._C._nn.linear}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
_BMM = {torch.bmm, torch.Tensor.bmm}
_ADDMM = {torch.addmm}  # GPT-2's Conv1D: addmm(bias, x, weight)
FUNCTIONS = frozenset(_LINEAR | _MATMUL | _BMM | _ADDMM)


class HalfGemmMode(TorchFunctionMode):
    """The matmul family as widened fp32 GEMMs while autocast runs fp16 on the CPU (see
    [Note: fp16 GEMMs on a CPU without fp16 arithmetic]). One instance per forward: it
    holds that forward's fp16 casts of fp32 leaf tensors (autocast's cast cache)."""

    def __init__(self) -> None:
        super().__init__()
        self._casts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def recompute_mode(self) -> "HalfGemmMode":
        """The mode for activation checkpointing's recomputation in backward ([Note:
        recomputation replays the forward's modes] in activation_checkpointing.py): the
        recomputed products are the forward's, bit for bit."""
        return HalfGemmMode()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FUNCTIONS and kwargs.get("out") is None:
            out = self._widened(func, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _widened(self, func, args, kwargs) -> Optional[torch.Tensor]:
        if not (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is _F16):
            return None
        if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is not None:
            return None  # traced, or inside a torch.func transform (vmap, grad, ...)
        if func in _LINEAR:
            a = args[0] if args else kwargs.get("input")
            b = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if not (_eligible(a) and _eligible(b) and (bias is None or _eligible(bias))):
                return None
            if b.dim() != 2 or a.dim() < 1 or a.shape[-1] != b.shape[1] or (bias is not None and bias.dim() > 1):
                return None
            kind, work = "linear", a.numel() * b.shape[0]
        elif func in _ADDMM:
            if len(args) != 3 or kwargs:  # beta/alpha given: torch's kernel
                return None
            bias, a, b = args
            if not (_eligible(a) and _eligible(b) and _eligible(bias)):
                return None
            if not (a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
                    and (tuple(bias.shape) == (b.shape[1],) or tuple(bias.shape) == (a.shape[0], b.shape[1]))):
                return None
            kind, work = "addmm", a.numel() * b.shape[1]
        else:
            if len(args) != 2 or kwargs:
                return None
            a, b = args
            bias = None
            if not (_eligible(a) and _eligible(b)):
                return None
            if func in (torch.mm, torch.Tensor.mm) and (a.dim() != 2 or b.dim() != 2):
                return None  # torch's kernel raises its own error
            batched = a.dim() == b.dim() >= 3
            if func in _BMM or (batched and func in _MATMUL):
                # bmm, or matmul over equal batch dims (eager attention's (B, H, S, D) products),
                # as a bmm over the flattened batch.
                if not (batched and (func not in _BMM or a.dim() == 3) and a.shape[:-2] == b.shape[:-2]
                        and a.shape[-1] == b.shape[-2]):
                    return None
                kind, work = "bmm", a.numel() * b.shape[-1]
            else:
                if not (a.dim() >= 2 and b.dim() == 2 and a.shape[-1] == b.shape[0]):
                    return None
                kind, work = "matmul2", a.numel() * b.shape[1]
        if work < MIN_WORK:
            return None
        a16, b16 = self._cast(a), self._cast(b)
        bias16 = None if bias is None else self._cast(bias)
        batch = None
        if kind == "bmm" and a.dim() > 3:
            batch = a.shape[:-2]
            a16, b16 = a16.reshape(-1, *a.shape[-2:]), b16.reshape(-1, *b.shape[-2:])
        if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (a16, b16, bias16)):
            out = _round(_gemm(kind, a16.to(_F32), b16.to(_F32), None if bias16 is None else bias16.to(_F32)))
        else:
            out = _WidenedGemm.apply(kind, a16, b16, bias16)
        return out if batch is None else out.reshape(*batch, *out.shape[-2:])

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in fp16 as autocast casts it: fp32 leaves that require grad cast once."""
        if t.dtype is _F16:
            return t
        # As autocast's cache: casts of leaf weights, made and reused only where autograd
        # records them (a cast made under no_grad has no history to give a later use).
        cached = t.is_leaf and t.requires_grad and torch.is_grad_enabled() and torch.is_autocast_cache_enabled()
        if cached:
            hit = self._casts.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
        with torch.autocast("cpu", enabled=False):
            cast = t.to(_F16)
        if cached:
            self._casts[id(t)] = (t, cast)
        return cast


def _eligible(t) -> bool:
    """A strided CPU tensor in fp32 or fp16 (what autocast would make fp16) that acts as a
    plain tensor: of torch's own classes, or any class while subclass torch functions are
    off (the sharded engines' guarded parameters inside the prepared forward, see
    [Note: guarded sharded parameters] in engines/gathered.py)."""
    return (isinstance(t, torch.Tensor) and t.dtype in (_F32, _F16) and t.device.type == "cpu"
            and t.layout is torch.strided
            and (type(t) in (torch.Tensor, torch.nn.Parameter) or not torch._C._is_torch_function_enabled()))
