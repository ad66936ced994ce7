"""``mixprec config import``: DeepSpeed JSON and Accelerate YAML configs converted to a
mixprec config, key by key.

Every key of the input gets one line in the report: what it became (``-> key: value``),
why it is ignored (it is set elsewhere in mixprec, e.g. the batch size is the
DataLoader's), or why it is REFUSED (it asks for behaviour mixprec does not have, e.g.
optimizer offload to NVMe). A refused key is never dropped silently: the command writes
nothing unless told to drop refused keys.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .fields import ConfigError, coerce_record, format_value
from .resolve import flatten, load_file
from .schema import TPLayerSpec, TPPresetModel

_DS_BACKENDS = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
# DeepSpeed's fp16 dynamic loss-scaler defaults (runtime/fp16 config).
_DS_FP16_DEFAULTS = {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
_AUTO = "'auto' is filled in by the HF Trainer integration; give the number itself"


@dataclass
class ImportReport:
    """The converted config (nested mapping), one report line per input key, refused keys."""

    kind: str  # "DeepSpeed" or "Accelerate"
    config: dict = field(default_factory=dict)
    lines: list[tuple[str, str]] = field(default_factory=list)  # (input "key = value", outcome)
    refused: list[str] = field(default_factory=list)
    _origin: dict = field(default_factory=dict)  # mixprec key -> input key that set it

    def set(self, src: str, value: Any, key: str, target: Any, note: str = "") -> None:
        """Record that input ``src`` (= ``value``) becomes mixprec ``key`` = ``target``."""
        previous = self._origin.get(key)
        current = self._get(key)
        if previous is not None and current != target:
            self.refuse(src, value, f"sets {key}={format_value(target)}, but {previous} already set "
                        f"{key}={format_value(current)}; make them agree")
            return
        self._origin.setdefault(key, src)
        node = self.config
        *blocks, leaf = key.split(".")
        for b in blocks:
            node = node.setdefault(b, {})
        node[leaf] = target
        self.lines.append((f"{src} = {_show(value)}", f"-> {key}: {format_value(target)}{note}"))

    def ignore(self, src: str, value: Any, why: str) -> None:
        self.lines.append((f"{src} = {_show(value)}", f"ignored: {why}"))

    def refuse(self, src: str, value: Any, why: str) -> None:
        self.lines.append((f"{src} = {_show(value)}", f"REFUSED: {why}"))
        self.refused.append(src)

    def _get(self, key: str) -> Any:
        node: Any = self.config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    def text(self) -> str:
        """The per-key report, aligned."""
        width = min(max((len(a) for a, _ in self.lines), default=0), 60)
        out = [f"importing a {self.kind} config:"]
        out += [f"  {a:<{width}}  {b}" for a, b in self.lines]
        if self.refused:
            out.append(f"{len(self.refused)} key(s) REFUSED: {', '.join(self.refused)}")
        return "\n".join(out)


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return format_value(tuple(value) if isinstance(value, list) else value)


def import_config(path: str) -> ImportReport:
    """Convert the DeepSpeed JSON or Accelerate YAML config at ``path``.

    Example::

        report = import_config("ds_config.json")
        print(report.text()); report.config   # {"backend": "zero3", "mixed_precision": "bf16", ...}
    """
    if Path(path).suffix.lower() == ".json":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path!r} is not a readable JSON file: {e}") from None
    else:
        data = load_file(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path!r} must hold a mapping of keys")
    if "distributed_type" in data or "compute_environment" in data:
        report = ImportReport("Accelerate")
        _accelerate(data, report)
    elif data.keys() & {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "fp16", "bf16",
                        "tensor_parallel", "compile", "sequence_parallel_size"}:
        report = ImportReport("DeepSpeed")
        _deepspeed(data, report)
    else:
        raise ConfigError(
            f"{path!r} is neither a DeepSpeed config (no zero_optimization/fp16/bf16/train_batch_size) "
            "nor an Accelerate config (no distributed_type/compute_environment)"
        )
    flatten(report.config, f"the config imported from {path}")  # the result must be a valid config
    return report


# ----------------------------------------------------------------------------- DeepSpeed
_DS_IGNORED = {
    "train_batch_size": "the batch size is your DataLoader's batch_size (per process)",
    "train_micro_batch_size_per_gpu": "the batch size is your DataLoader's batch_size (per process)",
    "steps_per_print": "mixprec does not log steps; print from your loop",
    "wall_clock_breakdown": "no DeepSpeed timers here; use the benchmarks or your own timing",
    "dump_state": "not applicable",
    "tensorboard": "log from your loop", "wandb": "log from your loop", "csv_monitor": "log from your loop",
    "comms_logger": "not applicable", "flops_profiler": "not applicable",
    "zero_force_ds_cpu_optimizer": "no DeepSpeed CPU optimizer here",
}
_DS_REFUSED = {
    "amp": "apex amp is not supported; use bf16 or fp16",
    "pipeline": "pipeline parallelism is not supported", "sparse_attention": "not supported",
    "compression_training": "not supported", "data_efficiency": "not supported",
    "elasticity": "elastic batch sizes are not supported",
    "aio": "NVMe offload is not supported",
}
_ZERO_IGNORED = {
    "allgather_bucket_size": "mixprec all-gathers per bucket (bucket_cap_mb)",
    "overlap_comm": "mixprec always overlaps reduction with backward",
    "contiguous_gradients": "mixprec gradients always live in flat buckets",
    "round_robin_gradients": "not applicable", "sub_group_size": "not applicable",
    "stage3_max_live_parameters": "zero3 frees each unit after use (reshard_after_forward)",
    "stage3_max_reuse_distance": "zero3 frees each unit after use (reshard_after_forward)",
    "stage3_param_persistence_threshold": "zero3 units are chosen by zero3.units",
    "stage3_gather_16bit_weights_on_model_save": "accelerator.save_model always gathers full weights",
    "gather_16bit_weights_on_model_save": "accelerator.save_model always gathers full weights",
    "memory_efficient_linear": "not applicable", "load_from_fp32_weights": "mixprec checkpoints hold fp32 masters",
    "elastic_checkpoint": "mixprec checkpoints reload at any world size",
    "ignore_unused_parameters": "not applicable to sharded engines",
    "zero_hpz_partition_size": "not applicable", "zero_quantized_weights": "not supported",
}


def _deepspeed(data: dict, r: ImportReport) -> None:
    zero = data.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    block = _DS_BACKENDS.get(stage) if isinstance(stage, int) else None
    if "zero_optimization" in data and not isinstance(zero, dict):
        r.refuse("zero_optimization", zero, "must be a mapping")
        zero = {}
    if block is None:
        r.refuse("zero_optimization.stage", stage, "ZeRO stage must be 0, 1, 2 or 3")
        block = "ddp"
    elif "stage" in zero:
        r.set("zero_optimization.stage", stage, "backend", block)
    precision = [k for k in ("bf16", "fp16") if isinstance(data.get(k), dict) and data[k].get("enabled") is True]
    for key, value in data.items():
        if key == "zero_optimization":
            for sub, v in zero.items():
                if sub != "stage":
                    _ds_zero_key(f"zero_optimization.{sub}", sub, v, block, r)
        elif key in ("bf16", "fp16"):
            _ds_precision(key, value, precision, r)
        elif _ds_training_key(key, value, block, r):
            pass
        elif key == "activation_checkpointing":
            _ds_activation_checkpointing(value, r)
        elif key == "tensor_parallel":
            _ds_tensor_parallel(value, r)
        elif key == "compile":
            _ds_compile(value, data.get("sequence_parallel_size"), r)
        elif key == "sequence_parallel_size":
            if "compile" not in data:  # with compile, _ds_compile reads it
                _ds_sp_size(key, value, r)
        elif key in _DS_IGNORED:
            r.ignore(key, value, _DS_IGNORED[key])
        elif key in _DS_REFUSED:
            r.refuse(key, value, _DS_REFUSED[key])
        else:
            r.refuse(key, value, "unknown DeepSpeed key, not converted; remove it or report it")


def _ds_training_key(key: str, value: Any, block: str, r: ImportReport) -> bool:
    """The DeepSpeed keys about the step (clipping, accumulation, optimizer, gradient
    communication); False for any other key."""
    if key == "gradient_clipping":
        if value == "auto":
            r.refuse(key, value, _AUTO)
        elif value == 0:
            r.ignore(key, value, "0 disables clipping in DeepSpeed (gradient_clipping: null, the default)")
        else:
            r.set(key, value, "gradient_clipping", float(value))
    elif key == "gradient_accumulation_steps":
        if value == "auto":
            r.refuse(key, value, _AUTO)
        else:
            r.set(key, value, "gradient_accumulation_steps", value)
    elif key in ("optimizer", "scheduler"):
        kind = value.get("type", "?") if isinstance(value, dict) else value
        r.ignore(key, value, f"create the {key} ({kind}) yourself in your script and pass it to prepare()")
    elif key == "zero_allow_untested_optimizer":
        if block == "ddp" or not value:
            r.ignore(key, value, "ddp steps the whole model: any optimizer works")
        else:
            r.set(key, value, f"{block}.elementwise_optimizer", True,
                  " (only for optimizers whose update is element-wise)")
    elif key == "communication_data_type":
        if str(value).lower() in ("fp32", "float32"):
            r.ignore(key, value, "mixprec reduces gradients in fp32")
        else:
            r.refuse(key, value, "mixprec reduces gradients in fp32 (reduced-precision gradient "
                     "communication is not supported); remove the key")
    elif key in ("prescale_gradients", "gradient_predivide_factor"):
        if value in (False, 1, 1.0):
            r.ignore(key, value, "mixprec averages gradients in fp32")
        else:
            r.refuse(key, value, "gradient pre-scaling is not supported (fp32 averaging); remove the key")
    else:
        return False
    return True


def _ds_zero_key(src: str, sub: str, value: Any, block: str, r: ImportReport) -> None:
    if value == "auto":
        r.refuse(src, value, _AUTO)
    elif sub == "reduce_bucket_size":
        mb = float(value) * 4 / 2**20  # DeepSpeed counts elements; mixprec buckets hold fp32 gradients
        r.set(src, value, f"{block}.bucket_cap_mb", mb, " (elements x 4 bytes of fp32 gradient, in MiB)")
    elif sub == "reduce_scatter":
        if block == "ddp":
            r.ignore(src, value, "ddp all-reduces")
        else:
            r.set(src, value, f"{block}.collective", "reduce_scatter" if value else "allreduce")
    elif sub == "stage3_prefetch_bucket_size":
        if block != "zero3":
            r.ignore(src, value, "only meaningful with stage 3")
        else:
            r.set(src, value, "zero3.prefetch", bool(value), " (mixprec prefetches the next unit)")
    elif sub == "leaf_module":
        _ds_leaf_module(src, value, block, r)
    elif sub in ("offload_optimizer", "offload_param"):
        device = value.get("device", "none") if isinstance(value, dict) else value
        if str(device).lower() in ("none", "null", "false"):
            r.ignore(f"{src}.device", device, "no offload (mixprec keeps everything on the training device)")
        else:
            what = "optimizer state" if sub == "offload_optimizer" else "parameters"
            r.refuse(f"{src}.device", device, f"{what} offload to {device} is not supported: mixprec keeps "
                     "them on the training device (shard them with zero2/zero3 instead)")
    elif sub == "cpu_offload":
        _refuse_when_on(r, src, value, "optimizer offload to cpu is not supported: mixprec keeps optimizer state "
                        "on the training device", "no offload")
    elif sub in _ZERO_IGNORED:
        r.ignore(src, value, _ZERO_IGNORED[sub])
    else:
        r.refuse(src, value, "unknown zero_optimization key, not converted; remove it or report it")


_DS_LEAF_KEYS = {"classes": "leaf_module_classes", "names": "leaf_module_names",
                 "name_suffixes": "leaf_module_name_suffixes"}


def _ds_leaf_module(src: str, value: Any, block: str, r: ImportReport) -> None:
    """``zero_optimization.leaf_module: {classes, names, name_suffixes}`` (DeepSpeed's ZeRO-3
    leaf modules) -> the zero3 block's ``leaf_module_*`` lists."""
    if not isinstance(value, dict):
        r.refuse(src, value, "leaf_module must be a mapping with classes / names / name_suffixes")
        return
    for key, items in value.items():
        if key not in _DS_LEAF_KEYS:
            r.refuse(f"{src}.{key}", items, f"unknown leaf_module key; valid: {sorted(_DS_LEAF_KEYS)}")
        elif block != "zero3":
            r.ignore(f"{src}.{key}", items, "leaf modules only matter with stage 3")
        elif not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
            r.refuse(f"{src}.{key}", items, "must be a list of strings")
        elif items:
            # DeepSpeed takes qualified class names; mixprec matches either form.
            r.set(f"{src}.{key}", items, f"zero3.{_DS_LEAF_KEYS[key]}", tuple(items))
        else:
            r.ignore(f"{src}.{key}", items, "empty")


def _ds_activation_checkpointing(value: Any, r: ImportReport) -> None:
    """[Note: importing DeepSpeed's activation_checkpointing]
    DeepSpeed checkpoints exactly the calls the model makes to
    ``deepspeed.checkpointing.checkpoint``: its config section names no module, it only
    tunes how those checkpoints are stored. mixprec checkpoints the modules its config names
    (``activation_checkpointing.modules``, or ``units: true`` on zero3/fsdp), so the section
    itself selects nothing and the report says to name the modules; each storage key is
    then mapped, ignored or refused on its own."""
    if not isinstance(value, dict):
        r.refuse("activation_checkpointing", value, "must be a mapping")
        return
    r.ignore("activation_checkpointing", "(section)",
             "DeepSpeed checkpoints only what the model passes to deepspeed.checkpointing.checkpoint; "
             "mixprec checkpoints the modules its config names: replace those calls by "
             "activation_checkpointing.modules: [<module class>] (or units: true on zero3)")
    for sub, v in value.items():
        src = f"activation_checkpointing.{sub}"
        if sub == "partition_activations":
            r.ignore(src, v, "splits checkpointed activations over model-parallel ranks; mixprec is "
                     "data-parallel only (a model-parallel group of 1: nothing to split)")
        elif sub == "cpu_checkpointing":
            if v:
                r.refuse(src, v, "moving checkpointed activations to CPU memory is not supported: they "
                         "stay on the training device; set it false")
            else:
                r.ignore(src, v, "off")
        elif sub == "contiguous_memory_optimization":
            if v:
                r.refuse(src, v, "copying checkpointed activations into one preallocated buffer is not "
                         "supported (each checkpoint keeps its own inputs); set it false")
            else:
                r.ignore(src, v, "off")
        elif sub == "number_checkpoints":
            r.ignore(src, v, "sizes the contiguous_memory_optimization buffer, which mixprec does not have")
        elif sub == "synchronize_checkpoint_boundary":
            r.ignore(src, v, "a device synchronize around each checkpoint, for profiling; not needed "
                     "for correct results")
        elif sub == "profile":
            r.ignore(src, v, "DeepSpeed's checkpoint timers; measure with benchmarks/bench_checkpointing.py")
        else:
            r.refuse(src, v, "unknown activation_checkpointing key, not converted; remove it")


_TP = "tensor_parallel"
_TP_SPECS = "tensor_parallel.partition_config.layer_specs"
# Keys of DeepSpeed's tensor_parallel section (runtime/tensor_parallel/config.py, TPTrainingConfig
# and its `tp` / `tensor_parallel` sub-block TPConfig) that configure nothing in mixprec.
_DS_TP_IGNORED = {
    "tp_overlap_comm": "DeepSpeed's switch to overlap its tensor-parallel all-reduce with compute; "
                       "not a mixprec setting",
    "keep_module_on_host": "DeepSpeed keeps loaded checkpoint tensors in host memory; mixprec splits "
                           "the weights of the model given to prepare()",
    "injection_policy_tuple": "DeepSpeed's inference injection policy; give the rules as "
                              "tensor_parallel.partition_config.layer_specs",
    "dtype": "the dtypes come from mixed_precision (and param_dtype)",
    "tp_grain_size": "DeepSpeed's split granularity for uneven shards (not active in its training); "
                     "not a mixprec setting",
    "mpu": "a model-parallel unit object; mixprec builds its groups from tensor_parallel.size",
    "tp_group": "a process group object; mixprec builds its groups from tensor_parallel.size",
}
# DeepSpeed's AutoTPConfig (module_inject/autotp_config.py) keys of partition_config besides
# use_default_specs / layer_specs: (DeepSpeed's default, why a non-default value is refused).
_DS_PARTITION_DEFAULTS = {
    "strict_mode": (False, "failing on Linear layers that no spec matches is not supported; set it false"),
    "embedding_partition_dim": (1, "the embedding split is not configurable here; remove it"),
    "lm_head_patterns": (["lm_head", "embed_out"], "not converted: give those layers a layer_specs entry"),
}
# DeepSpeed's TPLayerSpec flags mixprec has no counterpart for: off (false) is ignored.
_DS_SPEC_FLAGS = {
    "gather_output": "gathering a column-parallel output on every rank is not supported",
    "grad_allreduce": "summing a skipped parameter's gradient over the tensor-parallel group is not supported",
}


def _ds_tensor_parallel(value: Any, r: ImportReport) -> None:
    """DeepSpeed's AutoTP ``tensor_parallel`` section -> the ``tensor_parallel`` block."""
    if not isinstance(value, dict):
        r.refuse(_TP, value, "must be a mapping (autotp_size, preset_model, partition_config, ...)")
        return
    for sub, v in value.items():
        src = f"{_TP}.{sub}"
        if sub in ("autotp_size", "tp_size"):
            _ds_tp_size(src, v, r)
        elif sub in ("tp", "tensor_parallel"):  # TPConfig, DeepSpeed's older / inference spelling
            if not isinstance(v, dict):
                r.refuse(src, v, "must be a mapping with tp_size")
                continue
            for key, x in v.items():
                if key == "tp_size":
                    _ds_tp_size(f"{src}.{key}", x, r)
                elif key in _DS_TP_IGNORED:
                    r.ignore(f"{src}.{key}", x, _DS_TP_IGNORED[key])
                else:
                    r.refuse(f"{src}.{key}", x, f"unknown {sub} key, not converted; remove it")
        elif sub == "preset_model":
            presets = typing.get_args(TPPresetModel)
            if v is None:
                r.ignore(src, v, "no preset")
            elif isinstance(v, str) and v.lower() in presets:
                r.set(src, v, f"{_TP}.preset_model", v.lower())
            else:
                r.refuse(src, v, f"not a preset; use one of {', '.join(presets)}")
        elif sub == "partition_config":
            _ds_partition_config(src, v, r)
        elif sub in ("replace_with_kernel_inject", "kernel_inject"):
            _refuse_when_on(r, src, v, "DeepSpeed's inference kernel injection is not supported; set it false", "off")
        elif sub in _DS_TP_IGNORED:
            r.ignore(src, v, _DS_TP_IGNORED[sub])
        else:
            r.refuse(src, v, "unknown tensor_parallel key, not converted; remove it or report it")


# DeepSpeed's compile section (deepspeed/compile/config.py, CompileConfig): DeepCompile's own
# passes and options. Only the AutoSP pass has a mixprec counterpart: sequence_parallel, whose
# size DeepSpeed reads from the top-level ``sequence_parallel_size``
# (deepspeed/compile/custom_ops/sp_dp_registry.py, extract_mesh_size).
_DS_PASSES_IGNORED = {
    "z1": "the backend comes from zero_optimization.stage",
    "z3": "the backend comes from zero_optimization.stage",
    "autotp": "tensor parallelism comes from the tensor_parallel section",
}


def _ds_sp_size(src: str, value: Any, r: ImportReport) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        r.refuse(src, value, "must be an integer >= 1 (the sequence-parallel degree)")
    else:
        r.set(src, value, "sequence_parallel.size", value)


def _ds_compile(value: Any, sp_size: Any, r: ImportReport) -> None:
    """``compile: {passes: ["autosp"]}`` + ``sequence_parallel_size`` -> ``sequence_parallel.size``."""
    if not isinstance(value, dict):
        r.refuse("compile", value, "must be a mapping")
        return
    passes = value.get("passes") or []
    for key, v in value.items():
        src = f"compile.{key}"
        if key != "passes":
            r.ignore(src, v, "a DeepCompile option; mixprec does not compile the model (torch.compile it "
                             "yourself: sequence parallelism keeps working under it)")
    for name in passes if isinstance(passes, list) else [passes]:
        src = "compile.passes"
        if name == "autosp":
            if sp_size is None:
                r.ignore(src, name, "sequence_parallel_size is not given: AutoSP runs with size 1 (off)")
            else:
                _ds_sp_size("sequence_parallel_size", sp_size, r)
        elif name in _DS_PASSES_IGNORED:
            r.ignore(src, name, _DS_PASSES_IGNORED[name])
        else:
            r.refuse(src, name, "unknown DeepCompile pass, not converted; remove it or report it")
    if "autosp" not in (passes if isinstance(passes, list) else [passes]) and sp_size is not None:
        _ds_sp_size("sequence_parallel_size", sp_size, r)


def _ds_tp_size(src: str, value: Any, r: ImportReport) -> None:
    if value == "auto":
        r.refuse(src, value, _AUTO)
    elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
        r.refuse(src, value, "must be an integer >= 0 (the tensor-parallel degree)")
    elif value == 0:
        r.ignore(src, value, "0 disables AutoTP in DeepSpeed (tensor_parallel.size: 1, the default)")
    else:
        r.set(src, value, f"{_TP}.size", value)


def _ds_partition_config(src: str, value: Any, r: ImportReport) -> None:
    if value is None:
        r.ignore(src, value, "no custom rules")
        return
    if not isinstance(value, dict):
        r.refuse(src, value, "must be a mapping with use_default_specs / layer_specs")
        return
    for sub, v in value.items():
        key = f"{src}.{sub}"
        if sub == "use_default_specs":
            if isinstance(v, bool):
                r.set(key, v, f"{_TP}.partition_config.use_default_specs", v)
            else:
                r.refuse(key, v, "must be true or false")
        elif sub == "layer_specs":
            _ds_layer_specs(key, v, r)
        elif sub == "tp_size":
            r.ignore(key, v, "DeepSpeed replaces it with tensor_parallel.autotp_size")
        elif sub in _DS_PARTITION_DEFAULTS:
            default, why = _DS_PARTITION_DEFAULTS[sub]
            if v == default:
                r.ignore(key, v, "DeepSpeed's default")
            else:
                r.refuse(key, v, why)
        else:
            r.refuse(key, v, "unknown partition_config key, not converted; remove it or report it")


def _ds_pattern(pattern: Any) -> Any:
    r"""[Note: DeepSpeed's layer-spec patterns]
    DeepSpeed matches a spec's patterns with ``re.match`` against ``<module>.weight``;
    mixprec matches with ``re.search`` against ``<module>``. A trailing ``\.weight$`` (or
    ``\.weight``, ``.weight$``) becomes ``$``, and a pattern that is not anchored (``^``)
    nor starts with ``.*`` gets ``^``, so each pattern selects the same modules."""
    if not isinstance(pattern, str):
        return pattern
    for suffix in (r"\.weight$", ".weight$", r"\.weight", ".weight"):
        if pattern.endswith(suffix):
            pattern = pattern[: -len(suffix)] + "$"
            break
    if not pattern.startswith(("^", ".*")):
        pattern = f"^(?:{pattern})" if "|" in pattern else "^" + pattern
    return pattern


def _ds_layer_specs(src: str, value: Any, r: ImportReport) -> None:
    """Each DeepSpeed TPLayerSpec mapping -> a :class:`TPLayerSpec`. A key mixprec has no
    counterpart for is refused on its own (the entry is converted without it); an entry the
    schema rejects is refused whole, with the schema's error."""
    if not isinstance(value, list):
        r.refuse(src, value, "must be a list of mappings (patterns, partition_type, ...)")
        return
    specs, rewritten, defaulted = [], [], []
    for i, entry in enumerate(value):
        at = f"{src}[{i}]"
        if not isinstance(entry, dict):
            r.refuse(at, entry, "must be a mapping with patterns and partition_type")
            continue
        spec: dict = {}
        for key, x in entry.items():
            if key == "patterns":
                spec[key] = [_ds_pattern(p) for p in x] if isinstance(x, list) else x
                if isinstance(x, list) and spec[key] != x:
                    rewritten.append(f"[{i}] " + ", ".join(f"{a} -> {b}" for a, b in zip(x, spec[key]) if a != b))
            elif key == "partition_type":
                spec[key] = x.lower() if isinstance(x, str) else x
            elif key in ("shape", "partition_dim"):
                spec[key] = x
            elif key == "model_types":
                if x is not None:
                    spec[key] = x
            elif key in _DS_SPEC_FLAGS:
                if x:
                    r.refuse(f"{at}.{key}", x, f"{_DS_SPEC_FLAGS[key]}; set it false")
                else:
                    r.ignore(f"{at}.{key}", x, "off")
            else:
                r.refuse(f"{at}.{key}", x, "unknown layer spec key, not converted; remove it")
        if "partition_type" not in spec:
            spec["partition_type"] = "column"  # DeepSpeed's default
            defaulted.append(str(i))
        try:
            built = coerce_record(TPLayerSpec, spec, _TP_SPECS + f"[{i}]", "the DeepSpeed config")
        except ConfigError as e:
            r.refuse(at, entry, str(e))
            continue
        specs.append(built)
    if specs or not value:
        note = ""
        if rewritten:
            note += (" (DeepSpeed matches re.match on '<module>.weight', mixprec re.search on '<module>': "
                     + "; ".join(rewritten) + ")")
        if defaulted:
            note += f" (entries {', '.join(defaulted)}: partition_type column, DeepSpeed's default)"
        r.set(src, value, _TP_SPECS, tuple(specs), note)


def _ds_precision(key: str, value: Any, enabled: list[str], r: ImportReport) -> None:
    if not isinstance(value, dict):
        r.refuse(key, value, f"{key} must be a mapping with 'enabled'")
        return
    if value.get("enabled") == "auto":
        r.refuse(f"{key}.enabled", "auto", _AUTO)
        return
    if value.get("enabled") is not True:
        r.ignore(f"{key}.enabled", value.get("enabled"), f"{key} is off")
        return
    if len(enabled) > 1:
        r.refuse(f"{key}.enabled", True, "bf16 and fp16 are both enabled; enable one")
        return
    r.set(f"{key}.enabled", True, "mixed_precision", key)
    if key == "bf16":
        for sub, v in value.items():
            if sub != "enabled":
                r.ignore(f"bf16.{sub}", v, "mixprec's bf16 always keeps fp32 masters and reduces in fp32")
        return
    given = {k: v for k, v in value.items() if k != "enabled"}
    for sub, v in given.items():
        src = f"fp16.{sub}"
        if sub == "loss_scale":
            if v == 0:
                r.ignore(src, v, "0 = dynamic loss scaling, mixprec's fp16")
            else:
                r.refuse(src, v, "a static loss scale is not supported (mixprec scales dynamically); use 0")
        elif sub == "consecutive_hysteresis" and v:
            r.refuse(src, v, "consecutive hysteresis is not supported (hysteresis counts overflows in a row)")
        elif sub in ("auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"):
            r.ignore(src, v, "mixprec's fp16 keeps fp32 masters and autocasts the forward")
        elif sub not in _DS_FP16_DEFAULTS:
            r.refuse(src, v, "unknown fp16 key, not converted")
    for sub, default in _DS_FP16_DEFAULTS.items():
        v = given.get(sub, default)
        src = f"fp16.{sub}" + ("" if sub in given else " (DeepSpeed default)")
        if sub == "initial_scale_power":
            r.set(src, v, "scaler.init_scale", float(2**v), " (2**initial_scale_power)")
        elif sub == "loss_scale_window":
            r.set(src, v, "scaler.growth_interval", int(v))
        elif sub == "hysteresis":
            r.set(src, v, "scaler.hysteresis", int(v))
        else:
            r.set(src, v, "scaler.min_scale", float(v))


# ----------------------------------------------------------------------------- Accelerate
_ACC_LAUNCH = {
    "num_processes": "--nproc-per-node (per node) of `mixprec launch`",
    "num_machines": "--nnodes of `mixprec launch`",
    "machine_rank": "--node-rank of `mixprec launch`",
    "main_process_ip": "--master-addr of `mixprec launch`",
    "main_process_port": "--master-port of `mixprec launch`",
    "rdzv_backend": "`mixprec launch` uses a static rendezvous",
    "same_network": "not applicable", "gpu_ids": "set CUDA_VISIBLE_DEVICES",
    "main_training_function": "`mixprec launch` runs the script", "debug": "not applicable",
    "downcast_bf16": "TPU only", "enable_cpu_affinity": "not applicable",
    "tpu_env": "TPU only", "tpu_use_cluster": "TPU only", "tpu_use_sudo": "TPU only",
}
_ACC_DISTRIBUTED = {"NO": "single", "MULTI_CPU": "ddp", "MULTI_GPU": "ddp", "FSDP": "fsdp"}


def _accelerate(data: dict, r: ImportReport) -> None:
    dist = data.get("distributed_type", "NO")
    backend = _ACC_DISTRIBUTED.get(str(dist))
    ds = data.get("deepspeed_config") or {}
    if dist == "DEEPSPEED":
        stage = ds.get("zero_stage", 0)
        backend = _DS_BACKENDS.get(stage)
        if backend is None:
            r.refuse("deepspeed_config.zero_stage", stage, "ZeRO stage must be 0, 1, 2 or 3")
        else:
            r.set("distributed_type", dist, "backend", backend, f" (zero_stage {stage})")
    elif backend is None:
        r.refuse("distributed_type", dist, f"not supported; mixprec runs {', '.join(_ACC_DISTRIBUTED)} "
                 "and DEEPSPEED (as zero1/2/3)")
    elif "distributed_type" in data:
        r.set("distributed_type", dist, "backend", backend)
    for key, value in data.items():
        if key == "distributed_type":
            continue
        if key == "mixed_precision":
            if value in ("no", "bf16", "fp16"):
                r.set(key, value, "mixed_precision", value)
            else:
                r.refuse(key, value, "mixprec supports no, bf16 and fp16 (fp8 is not supported)")
        elif key == "use_cpu":
            r.set(key, value, "cpu", bool(value))
        elif key == "compute_environment":
            if value == "LOCAL_MACHINE":
                r.ignore(key, value, "mixprec runs where it is launched")
            else:
                r.refuse(key, value, "only LOCAL_MACHINE is supported")
        elif key == "gradient_accumulation_steps":
            r.set(key, value, "gradient_accumulation_steps", value)
        elif key == "fsdp_config":
            for sub, v in (value or {}).items():
                _acc_fsdp(f"fsdp_config.{sub}", sub, v, value, backend or "fsdp", r)
        elif key == "deepspeed_config":
            for sub, v in (value or {}).items():
                _acc_deepspeed(f"deepspeed_config.{sub}", sub, v, backend or "zero1", r)
        elif key == "dynamo_config":
            dyn = (value or {}).get("dynamo_backend", "NO")
            if str(dyn).upper() == "NO":
                r.ignore(key, value, "no torch.compile")
            else:
                r.refuse(key, value, "mixprec does not compile the model; call torch.compile yourself")
        elif key in _ACC_LAUNCH:
            r.ignore(key, value, _ACC_LAUNCH[key])
        elif key in ("megatron_lm_config", "ipex_config", "mpirun_config", "fp8_config") and not value:
            r.ignore(key, value, "empty")
        else:
            r.refuse(key, value, "not supported by mixprec; remove it")


def _acc_fsdp(src: str, sub: str, value: Any, whole: dict, backend: str, r: ImportReport) -> None:
    block = backend if backend in ("fsdp", "zero3") else None
    if sub in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward") and isinstance(value, (str, int)) and not isinstance(value, bool):
        name = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD"}.get(value, str(value)).upper()
        if name == "FULL_SHARD":
            r.set(src, value, "fsdp.reshard_after_forward", True)
        elif name == "SHARD_GRAD_OP":
            r.set(src, value, "fsdp.reshard_after_forward", False)
        elif name == "NO_SHARD":
            r.set(src, value, "backend", "ddp", " (no sharding is data parallel)")
        else:
            r.refuse(src, value, "hybrid sharding is not supported; use FULL_SHARD or SHARD_GRAD_OP")
    elif sub == "fsdp_reshard_after_forward":
        r.set(src, value, "fsdp.reshard_after_forward", bool(value))
    elif sub == "fsdp_auto_wrap_policy":
        if value == "TRANSFORMER_BASED_WRAP":
            names = whole.get("fsdp_transformer_layer_cls_to_wrap")
            if not names:
                r.refuse(src, value, "needs fsdp_transformer_layer_cls_to_wrap (the layer class names)")
            else:
                units = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
                r.set(f"{src} + fsdp_transformer_layer_cls_to_wrap", names, f"{block or 'fsdp'}.units", tuple(units))
        elif value == "SIZE_BASED_WRAP":
            n = whole.get("fsdp_min_num_params", 100_000_000)
            r.set(f"{src} + fsdp_min_num_params", n, f"{block or 'fsdp'}.units", f"size:{int(n)}")
        elif value == "NO_WRAP":
            r.set(src, value, f"{block or 'fsdp'}.units", (), " (the whole model is one unit)")
        else:
            r.refuse(src, value, "use TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP")
    elif sub in ("fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params"):
        if whole.get("fsdp_auto_wrap_policy") not in ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"):
            r.ignore(src, value, "used only with the matching fsdp_auto_wrap_policy")
    elif sub == "fsdp_backward_prefetch":
        r.set(src, value, f"{block or 'fsdp'}.prefetch", str(value).upper() != "NO_PREFETCH")
    elif sub == "fsdp_offload_params":
        if value:
            r.refuse(src, value, "parameter offload to cpu is not supported: mixprec keeps shards on the device")
        else:
            r.ignore(src, value, "no offload")
    elif sub == "fsdp_activation_checkpointing":
        if value:
            # Accelerate checkpoints the modules its auto-wrap policy wraps: the units.
            r.set(src, value, "activation_checkpointing.units", True, " (every sharding unit)")
        else:
            r.ignore(src, value, "off")
    elif sub in ("fsdp_state_dict_type",):
        r.ignore(src, value, "save_state writes sharded checkpoints, save_model full weights")
    elif sub in ("fsdp_sync_module_states", "fsdp_cpu_ram_efficient_loading"):
        r.ignore(src, value, "mixprec always starts every rank from rank 0's weights")
    elif sub in ("fsdp_use_orig_params", "fsdp_version", "fsdp_forward_prefetch"):
        r.ignore(src, value, "mixprec's fsdp is FSDP2-style (original parameters, per-unit prefetch)")
    else:
        r.refuse(src, value, "unknown fsdp_config key, not converted; remove it")


def _acc_deepspeed(src: str, sub: str, value: Any, backend: str, r: ImportReport) -> None:
    if sub == "zero_stage":
        return  # reported with distributed_type
    if sub == "gradient_accumulation_steps":
        r.set(src, value, "gradient_accumulation_steps", value)
    elif sub == "gradient_clipping":
        if value in (0, None):
            r.ignore(src, value, "no clipping")
        else:
            r.set(src, value, "gradient_clipping", float(value))
    elif sub in ("offload_optimizer_device", "offload_param_device"):
        if str(value).lower() in ("none", "null"):
            r.ignore(src, value, "no offload")
        else:
            r.refuse(src, value, f"offload to {value} is not supported: mixprec keeps everything on the "
                     "training device")
    elif sub in ("zero3_init_flag", "zero3_save_16bit_model"):
        r.ignore(src, value, "mixprec shards at prepare() and save_model gathers full weights")
    elif sub == "deepspeed_config_file":
        r.refuse(src, value, f"import that file itself: mixprec config import {value}")
    else:
        r.refuse(src, value, "unknown deepspeed_config key, not converted; remove it")


def _refuse_when_on(r: "ImportReport", src: str, value: Any, refused: str, ignored: str) -> None:
    """A DeepSpeed switch mixprec has no counterpart for: refused when on, ignored when off."""
    if value:
        r.refuse(src, value, refused)
    else:
        r.ignore(src, value, ignored)
