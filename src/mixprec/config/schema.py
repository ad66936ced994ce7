"""The typed configuration schema: every knob a mixprec run reads from a file, the
environment or ``Accelerator(...)`` arguments.

Each block is a frozen, keyword-only dataclass; the docstring under a field is its
documentation (``mixprec config reference`` prints it into docs/configuration.md). A
field's *constraint* (beyond its type) is given with :func:`checked`.

Example (YAML)::

    backend: zero3
    mixed_precision: bf16
    gradient_clipping: 1.0
    zero3:
      units: [TransformerEncoderLayer]
      prefetch: true
    sequence_parallel:
      size: 1
    tensor_parallel:
      size: 2
      partition_config:
        layer_specs:
          - {patterns: ['qkv_proj$'], partition_type: column, shape: [[4096, 1024, 1024], -1]}
          - {patterns: ['o_proj$'], partition_type: row}
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from ..policy import PRESETS, ScalerConfig
from .fields import REQUIRED

# The backends a config may name: "auto" and the engines of src/mixprec/engines/__init__.py
# (ENGINES, whose keys are these names in this order: tests/test_import_graph.py checks it).
# The names live here, below the engines, so the config reads without importing them.
BACKEND_NAMES = ("auto", "single", "ddp", "zero1", "zero2", "zero3", "fsdp")
Backend = Literal[BACKEND_NAMES]
MixedPrecision = Literal[PRESETS]  # "no", "bf16", "fp16", "bf16-pure"
Dtype = Literal["fp32", "bf16", "fp16"]
Collective = Literal["auto", "reduce_scatter", "allreduce"]
LossScaler = Literal["torch", "deepspeed"]
NonFiniteGrads = Literal["skip", "raise"]
CpuFp16Matmul = Literal["auto", "fp32", "native"]
TPPresetModel = Literal["llama", "qwen2", "mixtral", "deepseek_v2", "gpt2"]
TPPartitionType = Literal["column", "row", "skip"]


def checked(default, predicate, rule: str, why=None):
    """A dataclass field whose value must satisfy ``predicate``; ``rule`` says how (for errors).
    ``why(value)``, optional, says exactly what in a rejected value breaks the rule.
    ``default=REQUIRED``: a record field that must be given."""
    metadata = {"check": predicate, "rule": rule}
    if why is not None:
        metadata["why"] = why
    return field(default=default, metadata=metadata)


def labelled(default, label: str):
    """A field whose error for a value outside its choices starts the list with ``label``."""
    return field(default=default, metadata={"label": label})


def _positive(v) -> bool:
    return v > 0 and v != math.inf


def _at_least_one(v) -> bool:
    return v is None or v >= 1


def _regex_errors(patterns) -> list[str]:
    """What is wrong with each pattern that ``re`` does not compile."""
    errors = []
    for p in patterns:
        try:
            re.compile(p)
        except re.error as e:
            errors.append(f"{p!r} does not compile ({e})")
    return errors


def _why_patterns(patterns) -> str:
    if not patterns:
        return "the list is empty; give at least one regular expression"
    return "; ".join(_regex_errors(patterns)) + " (fix or escape it, e.g. '\\(' for a literal '(')"


def _shape_ok(shape) -> bool:
    if shape is None:
        return True
    if not shape:
        return False
    for dim in shape:
        if isinstance(dim, tuple):
            if not dim or any(v < 1 for v in dim):
                return False
        elif dim < 1 and dim != -1:
            return False
    return True


@dataclass(frozen=True, kw_only=True)
class DDPOptions:
    """``backend: ddp``: replicated parameters, gradients all-reduced in buckets during backward."""

    bucket_cap_mb: float = checked(25.0, _positive, "a number > 0 (MiB)")
    """Size cap of a gradient bucket, in MiB. A bucket is all-reduced as soon as all its
    gradients are ready."""
    first_bucket_cap_mb: float = checked(1.0, _positive, "a number > 0 (MiB)")
    """Cap of the first bucket (the last layers' gradients), in MiB: small, so communication
    starts early in backward."""
    find_unused_parameters: bool = False
    """Mark parameters that got no gradient in a backward as ready (needed when some
    forward passes skip parameters)."""
    broadcast_buffers: bool = True
    """Broadcast rank 0's buffers (e.g. BatchNorm statistics) before every forward."""


@dataclass(frozen=True, kw_only=True)
class ZeroOptions:
    """``backend: zero1`` / ``zero2``: fp32 master weights, optimizer state (and, stage 2,
    gradients) sharded over the processes."""

    bucket_cap_mb: float = checked(25.0, _positive, "a number > 0 (MiB)")
    """Size cap of a flat bucket, in MiB (the unit of reduce-scatter and all-gather)."""
    first_bucket_cap_mb: float = checked(1.0, _positive, "a number > 0 (MiB)")
    """Cap of the first bucket, in MiB."""
    collective: Collective = "auto"
    """How gradients are reduced into the shards: ``reduce_scatter``, ``allreduce`` (then
    each rank keeps its slice), or ``auto`` (reduce-scatter where the process group
    supports it)."""
    loss_scaler: LossScaler = "torch"
    """fp16 only: ``torch`` (torch.amp.GradScaler's dynamic scaler, configured by
    ``scaler``) or ``deepspeed`` (DeepSpeed's: growth every 1000 clean steps, hysteresis 2,
    minimum scale 1; replaces ``scaler``)."""
    elementwise_optimizer: bool = False
    """Accept an optimizer mixprec does not know to be element-wise (each rank steps a flat
    slice of the parameters). Set it only when the update of every element uses only that
    element's gradient and state."""
    broadcast_buffers: bool = True
    """Broadcast rank 0's buffers before every forward."""
    max_inflight_buckets: int = checked(2, lambda v: v >= 1, "an int >= 1")
    """zero2/zero3/fsdp: gradient buckets reduced at once during backward. When more are in
    flight, backward waits for the oldest, adds its slice into the gradient shard and frees
    its full-size fp32 bucket, so about ``max_inflight_buckets + 1`` buckets of fp32
    gradients (``bucket_cap_mb`` each) are alive instead of the whole fp32 gradient, when
    gradients arrive in bucket order (csrc/engines/sharded/core.h, ``[Note: bounded
    gradient memory]``). Higher: more communication overlapped, more memory. zero1
    reduces at the optimizer step and ignores it."""


@dataclass(frozen=True, kw_only=True)
class Zero3Options(ZeroOptions):
    """``backend: zero3``: + parameters sharded per unit, gathered around each unit's forward
    and backward."""

    units: Optional[Union[str, tuple[str, ...]]] = checked(
        None, lambda v: not isinstance(v, str) or v.startswith("size:"),
        "null, a list of module class names, or 'size:<min_params>'")
    """Which modules are gathered together: a list of module class names (e.g.
    ``[TransformerEncoderLayer]``; ``[]`` = the whole model is one unit), or
    ``"size:<min_params>"`` (a unit per module holding at least that many parameters not
    already in a smaller unit). null: ``"size:1000000"``."""
    prefetch: bool = True
    """Start gathering the next unit's parameters while the current unit computes."""
    reshard_after_forward: bool = True
    """Free a unit's gathered parameters after its forward (gathered again for backward).
    false keeps them until backward: more memory, one gather less per step."""
    leaf_module_classes: tuple[str, ...] = ()
    """ZeRO-3 leaf modules by class name (DeepSpeed's ``set_z3_leaf_modules``): each such
    module is gathered whole, as one unit, and no module inside it is a unit. Use it for a
    block whose submodules are called differently on each rank (a mixture-of-experts
    router), e.g. ``[MoEBlock]``."""
    leaf_module_names: tuple[str, ...] = ()
    """Leaf modules by dotted module path, e.g. ``[layers.3.moe]``."""
    leaf_module_name_suffixes: tuple[str, ...] = ()
    """Leaf modules by the end of their dotted path, e.g. ``[moe]`` matches ``layers.0.moe``
    and ``layers.1.moe``."""
    check_unit_order: Union[bool, Literal["every_gather"]] = True
    """Check that every rank runs the same sharding units in the same order: a unit only
    some ranks call stops the run with an error naming the unit on each rank, instead of
    pairing different collectives. true: one small all-gather per forward once the order
    is established, one before each unit gather while it is not (the first two forwards, and
    after the order changed); ``every_gather``: one before each unit gather always;
    false: off."""


@dataclass(frozen=True, kw_only=True)
class FSDPOptions(Zero3Options):
    """``backend: fsdp``: zero3 with FSDP2's names. The dtype fields are FSDP2's
    ``MixedPrecisionPolicy``; null follows ``mixed_precision``, a value that contradicts it
    is an error."""

    param_dtype: Optional[Dtype] = None
    """Storage dtype of the gathered parameters (adopted when ``mixed_precision`` keeps the
    model's own dtype)."""
    reduce_dtype: Optional[Dtype] = None
    """dtype gradients travel in across ranks: bf16/fp16 halve the bytes of each reduction;
    accumulation over micro-batches and into the gradient shard stays fp32."""
    output_dtype: Optional[Dtype] = None
    """dtype floating outputs of the model are cast to."""
    cast_forward_inputs: Optional[bool] = None
    """Cast floating inputs of the model to its parameter dtype."""


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingOptions:
    """Recompute the activations of chosen modules in backward instead of keeping them from
    forward (``torch.utils.checkpoint``, non-reentrant, RNG state restored so dropout
    recomputes exactly): less activation memory for one more forward of those modules per
    step. Applied at ``prepare()`` on every backend; nothing is checkpointed unless
    ``modules`` or ``units`` chooses something."""

    modules: tuple[str, ...] = ()
    """Module class names or dotted module paths (with wildcards) whose forward is
    checkpointed, e.g. ``[TransformerEncoderLayer]`` or ``['layers.*']``. A module inside
    another chosen module is not checkpointed again; the model itself cannot be named."""
    units: bool = False
    """zero3/fsdp only: checkpoint every sharding unit below the root (the modules
    ``zero3.units`` / ``fsdp.units`` choose), like Accelerate's
    ``fsdp_activation_checkpointing``."""
    selective: bool = False
    """Selective checkpointing (AutoSP's): in the chosen modules keep the outputs of the
    attention kernels (``scaled_dot_product_attention``) and of sequence parallelism's
    all-to-alls, and recompute everything else (the matmuls, norms, activations) in
    backward: no attention kernel and no collective runs again. false: recompute the whole
    module. Needs ``modules`` or ``units`` to choose the modules (docs/backends.md)."""


@dataclass(frozen=True, kw_only=True)
class TPLayerSpec:
    """One rule of ``tensor_parallel.partition_config.layer_specs`` (DeepSpeed AutoTP's
    ``TPLayerSpec``): how the parameters whose names match ``patterns`` are split over the
    tensor-parallel group."""

    patterns: tuple[str, ...] = checked(
        REQUIRED, lambda v: bool(v) and not _regex_errors(v),
        "a non-empty list of regular expressions (Python re)", _why_patterns)
    """Regular expressions matched with ``re.search`` against the parameter name without
    ``.weight``/``.bias``, e.g. ``model.layers.0.self_attn.q_proj``; the first spec with a
    matching pattern applies."""
    partition_type: TPPartitionType
    """``column`` (split the output features: dim 0 of the ``[out, in]`` weight, and the
    bias), ``row`` (split the input features: dim 1; the outputs are summed over the group)
    or ``skip`` (keep the parameter whole on every rank)."""
    shape: Optional[tuple[Union[int, tuple[int, ...]], ...]] = checked(
        None, _shape_ok,
        "null or a list of dims, each an int >= 1, -1 (the whole dim) or a list of ints >= 1 "
        "(sub-parameter sizes), e.g. [[4096, 1024, 1024], -1] or [2, -1]")
    """DeepSpeed's sub-parameter shape of a fused weight: ``[[q, kv, kv], -1]``: dim 0 is
    made of 3 sub-parameters of sizes q, kv, kv (each split on its own), dim 1 whole;
    ``[2, -1]``: 2 equal sub-parameters on dim 0 (e.g. ``gate_up_proj``). null: one
    parameter."""
    partition_dim: Optional[int] = checked(None, lambda v: v is None or v in (0, 1), "null, 0 or 1")
    """The dim that is split. null: 0 for ``column``, 1 for ``row``."""
    model_types: tuple[str, ...] = ()
    """HF ``config.model_type`` values the spec applies to, e.g. ``[llama, mistral]``;
    ``[]``: every model."""


@dataclass(frozen=True, kw_only=True)
class TPPartitionConfig:
    """Which parameters tensor parallelism splits, and how."""

    use_default_specs: bool = True
    """Parameters no spec of ``layer_specs`` matches are split by the defaults: the model's
    HF ``tp_plan``, the ``preset_model`` rules, or mixprec's heuristics. false: only
    ``layer_specs`` split anything."""
    layer_specs: tuple[TPLayerSpec, ...] = ()
    """Rules tried in order, each a mapping with ``patterns`` (required), ``partition_type``
    (required), ``shape``, ``partition_dim`` and ``model_types`` (see
    :class:`mixprec.config.TPLayerSpec`), e.g. ``[{patterns: ['qkv_proj$'],
    partition_type: column, shape: [[4096, 1024, 1024], -1]}, {patterns: ['o_proj$'],
    partition_type: row}]``. In an env var or a flag: the list as YAML/JSON text."""


@dataclass(frozen=True, kw_only=True)
class TensorParallelOptions:
    """Tensor parallelism (DeepSpeed's AutoTP): linear weights split over groups of
    ``size`` consecutive ranks (ranks 0..size-1 form the first group); data parallelism runs
    across the groups, so the world size must be a multiple of ``size``."""

    size: int = checked(1, lambda v: v >= 1, "an int >= 1")
    """Ranks in one tensor-parallel group. 1: off."""
    preset_model: Optional[TPPresetModel] = None
    """Built-in partition rules of a model family: ``llama``, ``qwen2``, ``phi3``,
    ``mixtral``, ``deepseek_v2``, ``gpt2`` (transformers Conv1D). null: the model's HF ``tp_plan``
    or mixprec's heuristics."""
    partition_config: TPPartitionConfig = field(default_factory=TPPartitionConfig)
    """Custom partition rules."""


@dataclass(frozen=True, kw_only=True)
class SequenceParallelOptions:
    """Sequence parallelism (DeepSpeed's AutoSP, Ulysses): every sequence split over groups
    of ``size`` consecutive ranks (ranks 0..size-1 form the first group), attention run over
    the whole sequence for a share of the heads (docs/sequence_parallel.md); data
    parallelism runs across the groups, so the world size must be a multiple of ``size``."""

    size: int = checked(1, lambda v: v >= 1, "an int >= 1")
    """Ranks in one sequence-parallel group. 1: off."""
    prepare_batches: bool = False
    """A prepared DataLoader hands out ``Accelerator.prepare_sp_inputs(**batch)`` for every
    batch (a mapping with ``input_ids`` and optional ``labels``, ``position_ids``,
    ``attention_mask``): this rank's slice, shifted labels and the loss normaliser."""
    seq_dim: int = checked(1, lambda v: v >= 0, "an int >= 0")
    """The sequence dimension of the batches ``prepare_batches`` slices."""


# Backend name -> the block of options its engine takes (single takes none).
BACKEND_BLOCKS: dict[str, type] = {
    "ddp": DDPOptions,
    "zero1": ZeroOptions,
    "zero2": ZeroOptions,
    "zero3": Zero3Options,
    "fsdp": FSDPOptions,
}


@dataclass(frozen=True, kw_only=True)
class MixprecConfig:
    """Everything a run is configured with. Each value comes from exactly one source:
    its default, the config file, a ``MIXPREC_*`` environment variable, or an
    ``Accelerator(...)`` argument (two sources with different values are an error)."""

    backend: Backend = labelled("auto", "valid backends: ")
    """Distribution backend: ``single``, ``ddp``, ``zero1``, ``zero2``, ``zero3``, ``fsdp``;
    ``auto`` is ddp when several processes run and single otherwise."""
    mixed_precision: MixedPrecision = "no"
    """Precision preset: ``no`` (fp32), ``bf16`` (fp32 masters, bf16 compute), ``fp16`` (+
    dynamic loss scaling), ``bf16-pure`` (bf16 weights updated without fp32 masters; single
    and ddp only)."""
    gradient_accumulation_steps: int = checked(1, lambda v: v >= 1, "an int >= 1")
    """Micro-batches per optimizer step; the loss is divided by it once."""
    gradient_clipping: Optional[float] = checked(None, lambda v: v is None or _positive(v), "null or a number > 0")
    """Clip the global gradient norm (L2) to this value before every real optimizer step,
    unless ``accelerator.clip_grad_norm_`` was called for that step. null: no automatic
    clipping."""
    max_consecutive_overflows: Optional[int] = checked(20, _at_least_one, "null or an int >= 1")
    """fp16: stop with an error after this many optimizer steps in a row skipped for
    overflow (the loss scale cannot recover). null: never stop."""
    nonfinite_grads: NonFiniteGrads = "skip"
    """bf16/fp32: what an optimizer step does when a gradient holds inf/nan on any rank.
    ``skip``: every rank skips the step (``StepResult(stepped=False, reason='nonfinite')``,
    weights, fp32 masters, optimizer state and prepared schedulers unchanged), counts it in
    ``accelerator.skipped_steps`` and logs a warning. ``raise``: every rank raises
    :class:`mixprec.NonFiniteGradientsError` naming the step, nothing updated. fp16 keeps
    its loss-scaler logic (``overflow``, see ``max_consecutive_overflows``)."""
    clip_in_step: bool = True
    """``clip_grad_norm_`` reads the gradients once (the norm, with the inf/nan check and,
    under fp16, the unscale folded in) and the fused optimizer update applies the clip in
    the pass that reads them anyway: two passes over the gradients fewer than torch's
    ``unscale_`` + ``clip_grad_norm_``, same weights. Until ``step()`` the gradients then
    hold their unclipped (fp16: still scaled) values; mixprec's own readers
    (``unscale_gradients``, ``clip_grad_value_``) apply the clip first. false: clip (and
    unscale) in place at once, as torch does, for loops that read ``p.grad`` between clip
    and step."""
    cache_weight_casts: bool = True
    """single/ddp under bf16/fp16 autocast with fp32 weights: the fused optimizer update
    also writes a bf16/fp16 copy of each large ``nn.Linear``/``nn.Conv{1,2,3}d`` weight
    (>= 32768 elements),
    and the forward uses it instead of casting the weight again: the same numbers as
    autocast's cast, one pass over the weights fewer per step, for a persistent 2-byte copy
    per cached parameter. The copy is dropped from use whenever the weight is written
    outside the update (its version changes); a write through ``p.data`` is not seen, so
    loops that write weights that way set false. false: autocast casts every forward."""
    cpu_fp16_matmul: CpuFp16Matmul = "auto"
    """fp16 autocast on a CPU: how ``F.linear``/``matmul``/``mm``/``bmm`` run. ``auto``: where
    the CPU has no fp16 arithmetic (no AVX512-FP16 or AMX-FP16: AMD, Intel before Sapphire
    Rapids) as the fp32 GEMM of the fp16 inputs, rounded to fp16 once, as torch's portable
    fp16 kernel computes them but 3-25x faster; torch's own kernels elsewhere. ``fp32``:
    always so. ``native``: torch's kernels. The results differ from torch's only in the
    order the fp32 sums are taken."""
    collective_timeout: Optional[float] = checked(
        30.0, lambda v: v is None or _positive(v), "null or a number > 0 (seconds)")
    """Collective desync detection: a rank inside one collective call (``gather``,
    ``wait_for_everyone``, ``optimizer.step``, ...) longer than this many seconds makes every
    rank print which rank did not arrive or made another call, with its source line or its
    Python stack, and stop (exit code 87; the waiting rank raises
    :class:`mixprec.CollectiveDesyncError` where it can). Calls whose tensors must agree
    (``gather``, ``reduce``, ``broadcast``, ...) are checked first: a different call or shape
    on another rank raises on every rank at once. null: off (a desync then hangs until the
    process group's timeout). See docs/troubleshooting.md."""
    param_dtype: Optional[Dtype] = None
    """Store trainable parameters in this dtype (bf16/fp16) with fp32 masters. null keeps
    the model's own dtype."""
    keep_fp32_modules: tuple[str, ...] = ()
    """Module class names or dotted module paths that run in fp32 (autocast off, fp32
    parameters), e.g. ``[LayerNorm, head]``."""
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    """fp16 dynamic loss scaling (ignored by bf16 and fp32)."""
    cpu: bool = False
    """Run on the CPU even when CUDA is available."""
    fused_optimizer: bool = True
    """Step Adam, AdamW and SGD with mixprec's fused kernels when eligible."""
    step_scheduler_with_optimizer: bool = True
    """Prepared LR schedulers step once per real optimizer step."""
    log_policy: bool = True
    """Print the resolved precision policy at the first ``prepare()``."""
    split_batches: bool = False
    """Prepared dataloaders split each batch across processes instead of giving each
    process its own batches."""
    even_batches: bool = True
    """Every process gets the same number of batches (the last are completed from the
    start of the dataset)."""
    data_seed: Optional[int] = None
    """Seed of the shuffling shared by all processes. null: drawn on rank 0."""
    ddp: DDPOptions = field(default_factory=DDPOptions)
    """Options of ``backend: ddp``."""
    zero1: ZeroOptions = field(default_factory=ZeroOptions)
    """Options of ``backend: zero1``."""
    zero2: ZeroOptions = field(default_factory=ZeroOptions)
    """Options of ``backend: zero2``."""
    zero3: Zero3Options = field(default_factory=Zero3Options)
    """Options of ``backend: zero3``."""
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    """Options of ``backend: fsdp``."""
    activation_checkpointing: ActivationCheckpointingOptions = field(
        default_factory=ActivationCheckpointingOptions)
    """Which modules recompute their activations in backward (all backends)."""
    tensor_parallel: TensorParallelOptions = field(default_factory=TensorParallelOptions)
    """Tensor parallelism: weights split over groups of consecutive ranks."""
    sequence_parallel: SequenceParallelOptions = field(default_factory=SequenceParallelOptions)
    """Sequence parallelism: sequences split over groups of consecutive ranks."""
