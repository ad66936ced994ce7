"""``mixprec config explain``: the resolved configuration, each value with its source, and
the dtypes every backend would use for the resolved precision policy."""

from __future__ import annotations

from typing import Optional

import torch

from ..engines import ENGINES
from ..engines.zero import DEEPSPEED_SCALER
from ..policy import PrecisionPolicy, dtype_name
from .fields import DTYPES, format_value
from .resolve import ResolvedConfig, engine_kwargs
from .schema import BACKEND_BLOCKS, MixprecConfig

BACKENDS = tuple(ENGINES)  # "single", "ddp", "zero1", "zero2", "zero3", "fsdp"
_LOW = (torch.bfloat16, torch.float16)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def policy_of(config: MixprecConfig) -> PrecisionPolicy:
    """The :class:`PrecisionPolicy` a config resolves to (what ``Accelerator`` builds)."""
    overrides: dict = {"scaler": config.scaler}
    if config.param_dtype is not None:
        overrides["param_dtype"] = DTYPES[config.param_dtype]
    if config.keep_fp32_modules:
        overrides["keep_fp32_modules"] = tuple(config.keep_fp32_modules)
    return PrecisionPolicy.from_mixed_precision(config.mixed_precision, **overrides)


def precision_row(backend: str, policy: PrecisionPolicy, config: MixprecConfig) -> tuple[str, ...]:
    """``(backend, params, compute, grad reduce, accumulate, masters, loss scaling)`` for one
    backend, as its engine applies ``policy``. Every fact is asked of the backend's Comm class
    (src/mixprec/engines): ``owns_masters``, ``shards_parameters``, ``distributed`` and
    ``run_policy`` (the policy its ``__init__`` runs for these ``engine_options``);
    tests/test_explain_facts.py builds each engine and checks this row against it."""
    comm = ENGINES[backend]
    sharded = comm.owns_masters  # the optimizer steps fp32 master shards the comm owns (zero1/2/3, fsdp)
    options = engine_kwargs(config, backend)
    if sharded and policy.master_dtype is None:
        return (backend, f"not supported: {backend} keeps fp32 master shards, "
                f"mixed_precision={policy.name!r} has none (use 'bf16')", "", "", "", "", "")
    try:  # e.g. fsdp: FSDP2's MixedPrecisionPolicy fields map onto the policy
        policy = comm.run_policy(policy, **options)
    except ValueError as e:
        return (backend, f"error: {e}", "", "", "", "", "")
    stored = dtype_name(policy.param_dtype) if policy.param_dtype is not None else "as given"
    if comm.shards_parameters:
        stored += ", 1/N shard (gathered per unit)"
    if not comm.distributed:
        reduce = "- (one process)"
    elif sharded:  # [Note: low-precision reduction] (csrc/engines/sharded/core.h): added into fp32 shards
        reduce = f"{dtype_name(policy.reduce_dtype)} (reduce-scatter into fp32 shards)"
    else:
        reduce = dtype_name(policy.reduce_dtype)
    if policy.master_dtype is None:
        masters = "none (low-precision weights updated in place)"
    elif sharded:
        masters = "fp32, 1/N shard"
    elif policy.param_dtype in _LOW:
        masters = "fp32"
    else:
        masters = "fp32 params (+ fp32 masters for bf16/fp16 params)"
    scaling = "off"
    if policy.loss_scaling:
        scaler = policy.scaler  # the engine's (run_policy: zero's loss_scaler='deepspeed' replaces it)
        kind = "deepspeed" if scaler is DEEPSPEED_SCALER else "torch"
        scaling = (f"dynamic, {kind} (init {format_value(scaler.init_scale)}, grow every "
                   f"{scaler.growth_interval}, hysteresis {scaler.hysteresis})")
    return (backend, stored, dtype_name(policy.compute_dtype), reduce,
            dtype_name(policy.accumulate_dtype), masters, scaling)


def precision_table(config: MixprecConfig) -> str:
    """The dtypes of every backend for ``config``'s precision policy, one row per backend."""
    policy = policy_of(config)
    rows = [("backend", "params", "compute", "grad reduce", "accumulate", "masters", "loss scaling")]
    rows += [precision_row(b, policy, config) for b in BACKENDS]
    return _table(rows)


def explain(resolved: ResolvedConfig, *, world_size: Optional[int] = None) -> str:
    """A report of ``resolved``: every key of the top level, of ``scaler`` and of the
    selected backend's block with its value and source; the changed keys of other backends'
    blocks (kept, unused); the precision table."""
    cfg = resolved.config
    lines = []
    runs = resolved.backend if cfg.backend != "auto" else f"{resolved.backend} (auto"
    if cfg.backend == "auto":
        runs += f" for WORLD_SIZE={world_size})" if world_size is not None else ")"
    lines.append(f"mixprec config: backend {cfg.backend!r} runs {runs}, mixed_precision={cfg.mixed_precision!r}")
    lines.append("files read: " + (", ".join(resolved.files) if resolved.files else "none"))
    if cfg.mixed_precision == "fp16":
        from ..wrappers.half_gemm import describe

        lines.append(f"fp16 matmuls on the CPU (cpu_fp16_matmul): {describe(cfg.cpu_fp16_matmul)}")
    lines.append("")
    used, unused = [("key", "value", "source")], []
    for path, setting in resolved.settings.items():
        block = path.split(".")[0] if "." in path else None
        row = (path, format_value(setting.value), setting.source)
        if block in BACKEND_BLOCKS and block != resolved.backend:
            if setting.kind != "default":
                unused.append(row)
        else:
            used.append(row)
    lines.append(_table(used))
    if resolved.backend not in BACKEND_BLOCKS:
        lines.append(f"(backend {resolved.backend!r} takes no engine options)")
    if unused:
        lines.append("")
        lines.append(f"kept but unused (backend is {resolved.backend!r}):")
        lines.append(_table([("key", "value", "source"), *unused]))
    lines.append("")
    lines.append(f"precision per backend for mixed_precision={cfg.mixed_precision!r}"
                 f" (this run: {resolved.backend}):")
    lines.append(precision_table(cfg))
    return "\n".join(lines)

