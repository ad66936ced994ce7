"""Resolving a configuration from its sources: defaults, config files, ``MIXPREC_*``
environment variables and ``Accelerator(...)`` arguments.

[Note: one source per value]
There is no precedence order. A key may be given by any number of sources as long as they
agree; two sources with different values are a :class:`ConfigError` naming both sources and
both values. A value that silently overrides another (the config file says zero3, an env var
left over from another job says ddp) is the failure this rule removes. Resolution reads the
environment mapping it is given and nothing else: no process-global state is written, so two
Accelerators with different settings coexist in one process.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from .fields import ConfigError, FieldInfo, block_fields, coerce, format_value, is_block, leaves, suggest
from .schema import BACKEND_BLOCKS, MixprecConfig

CONFIG_FILE_ENV = "MIXPREC_CONFIG_FILE"
ENV_PREFIX = "MIXPREC_"
ConfigLike = Union[str, os.PathLike, Mapping[str, Any], MixprecConfig, None]


def env_name(path: str) -> str:
    """The environment variable of a key: ``zero3.prefetch`` -> ``MIXPREC_ZERO3_PREFETCH``."""
    return ENV_PREFIX + path.replace(".", "_").replace("-", "_").upper()


def all_leaves() -> dict[str, FieldInfo]:
    """Every key of :class:`MixprecConfig`, by dotted path."""
    return leaves(MixprecConfig)


ENV_NAMES = {env_name(p): p for p in all_leaves()}
assert len(ENV_NAMES) == len(all_leaves()), "two config keys share an environment variable name"


@dataclass(frozen=True)
class Setting:
    """A resolved value and where it came from (``"default"``, ``"file mixprec.yaml"``,
    ``"env MIXPREC_BACKEND"``, ``"argument backend="``, ...)."""

    value: Any
    source: str

    @property
    def kind(self) -> str:
        """``default``, ``file``, ``env``, ``arg`` or ``object``."""
        return {"argument": "arg", "config": "object"}.get(self.source.split()[0], self.source.split()[0])


@dataclass(frozen=True)
class ResolvedConfig:
    """The configuration of one Accelerator: the typed values, each value's source, and the
    backend it runs (``auto`` resolved for the world size)."""

    config: MixprecConfig
    settings: dict[str, Setting]  # dotted key -> value and source, every key of the schema
    backend: str  # engine name: "single", "ddp", "zero1", "zero2", "zero3" or "fsdp"
    files: tuple[str, ...] = ()  # config files read

    def source(self, path: str) -> str:
        """Where ``path``'s value came from (see :class:`Setting`)."""
        return self.settings[path].source

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments for the selected backend's engine, from its block."""
        return engine_kwargs(self.config, self.backend)


def engine_kwargs(config: MixprecConfig, backend: str) -> dict[str, Any]:
    """The engine keyword arguments of ``backend``'s block. null fields that mean "the
    engine's default / follow mixed_precision" are left out."""
    if backend not in BACKEND_BLOCKS:
        return {}
    block = getattr(config, backend)
    return {k: v for k, v in dataclasses.asdict(block).items() if v is not None}


def load_file(path: Union[str, os.PathLike]) -> dict:
    """The mapping in a YAML (or JSON, by ``.json`` suffix) config file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read ({e.strerror}); pass an existing file") from None
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text) if text.strip() else {}
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - any parser error becomes one message
        raise ConfigError(f"config file {str(path)!r} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys, got {type(data).__name__}")
    return data


# Top-level keys that mark a DeepSpeed JSON or an Accelerate YAML (`mixprec config import`
# converts both, src/mixprec/config/importers.py); only those mixprec has no key of its own for count.
_DEEPSPEED_KEYS = {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "fp16", "bf16",
                   "optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
                   "activation_checkpointing", "sequence_parallel_size", "compile", "amp"}
_ACCELERATE_KEYS = {"distributed_type", "compute_environment"}


def refuse_foreign_format(data: Mapping, path: Union[str, os.PathLike]) -> None:
    """Raise a :class:`ConfigError` naming ``mixprec config import`` when the file at ``path``
    is a DeepSpeed or Accelerate config rather than a mixprec one."""
    fields = block_fields(MixprecConfig)
    unknown = [str(k) for k in data if k not in fields]
    if not unknown:
        return
    if set(unknown) & _ACCELERATE_KEYS:
        kind = "an Accelerate config (the YAML `accelerate config` writes)"
    elif set(unknown) & _DEEPSPEED_KEYS:
        kind = "a DeepSpeed config"
    else:
        return
    raise ConfigError(
        f"config file {str(path)!r} is {kind}, not a mixprec config (its keys {', '.join(unknown[:5])} are not "
        f"mixprec's): convert it with `mixprec config import {path} -o mixprec.yaml` (it lists what each key "
        f"became, was ignored or refused) and pass config='mixprec.yaml'"
    )


def flatten(data: Mapping, source: str, cls: type = MixprecConfig, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: normalised value}`` of a nested mapping; unknown keys and wrong types
    raise a :class:`ConfigError` naming the key path and what is valid."""
    out: dict[str, Any] = {}
    fields = block_fields(cls)
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            where = f"in block {prefix[:-1]!r}" if prefix else "at the top level"
            raise ConfigError(
                f"unknown config key {path!r} (from {source}).{suggest(str(key), fields)} "
                f"Valid keys {where}: {', '.join(fields)}"
            )
        tp = fields[key][0]
        if is_block(tp):
            if isinstance(value, tp):
                out.update(flatten_object(value, prefix=path + "."))
            elif isinstance(value, Mapping):
                out.update(flatten(value, source, tp, path + "."))
            else:
                raise ConfigError(
                    f"config key {path!r} (from {source}) must be a block of keys "
                    f"({', '.join(block_fields(tp))}), got {value!r}"
                )
        else:
            out[path] = coerce(leaves(cls, prefix)[path], value, source)
    return out


def flatten_object(obj: Any, prefix: str = "") -> dict[str, Any]:
    """The leaves of a schema dataclass instance that differ from their defaults (a field
    left at its default is not "given" by the object)."""
    out: dict[str, Any] = {}
    for name, (tp, default, _f) in block_fields(type(obj)).items():
        value = getattr(obj, name)
        path = f"{prefix}{name}"
        if is_block(tp):
            out.update(flatten_object(value, path + "."))
        else:
            info = leaves(type(obj), prefix)[path]
            normal = coerce(info, value, "the config object")
            if normal != coerce(info, default, "the schema default"):
                out[path] = normal
    return out


def read_env(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """``{dotted key: (value, source)}`` from ``MIXPREC_<KEY>`` variables. A ``MIXPREC_``
    variable that is not a key but close to one (a typo) is an error."""
    out: dict[str, tuple[Any, str]] = {}
    infos = all_leaves()
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        path = ENV_NAMES.get(name)
        if path is None:
            close = difflib.get_close_matches(name, list(ENV_NAMES), n=1, cutoff=0.88)
            if close:
                raise ConfigError(
                    f"environment variable {name}={raw!r} is not a mixprec config variable. Did you "
                    f"mean {close[0]}? (unset it, or rename it)"
                )
            continue
        source = f"env {name}"
        out[path] = (coerce(infos[path], raw, source, text=True), source)
    return out


def effective_backend(backend: str, world_size: int) -> str:
    """The engine ``backend`` runs: ``auto`` is ddp with several processes, single alone."""
    if backend == "auto":
        return "ddp" if world_size > 1 else "single"
    return backend


def resolve(
    config: ConfigLike = None,
    args: Optional[Mapping[str, tuple[Any, str]]] = None,
    engine_options: Optional[Mapping[str, Any]] = None,
    env: Optional[Mapping[str, str]] = None,
    world_size: Optional[int] = None,
    backend_options: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> ResolvedConfig:
    """Merge every source into one :class:`ResolvedConfig`.

    ``config``: a file path, a mapping or a :class:`MixprecConfig`; the file named by
    ``MIXPREC_CONFIG_FILE`` (set by ``mixprec launch --config-file``) is read too. ``args``:
    ``{dotted key: (value, argument name)}`` of the constructor arguments given.
    ``engine_options``: the constructor's dict for the selected backend's block. ``env``:
    the environment (default ``os.environ``). ``world_size``: to resolve ``backend: auto``
    and check that it is a multiple of ``tensor_parallel.size`` (default ``$WORLD_SIZE`` or
    1; a world of one process is not checked: nothing is launched yet).
    ``backend_options``: ``{backend: options}`` that join ``engine_options`` only when that
    backend runs, ``engine_options`` winning on a shared key (Accelerate's
    ``DistributedDataParallelKwargs`` give ``{"ddp": {...}}``).

    Example::

        resolved = resolve("mixprec.yaml", args={"mixed_precision": ("bf16", "mixed_precision")})
        resolved.config.backend, resolved.source("backend")
    """
    env = os.environ if env is None else env
    if world_size is None:
        world_size = int(env.get("WORLD_SIZE", "1"))
    infos = all_leaves()
    given: dict[str, list[tuple[Any, str]]] = {}

    def add(path: str, value: Any, source: str) -> None:
        given.setdefault(path, []).append((value, source))

    files = _read_sources(config, env, add)
    for path, (value, source) in read_env(env).items():
        add(path, value, source)
    for path, (value, name) in (args or {}).items():
        source = f"argument {name}="
        add(path, coerce(infos[path], value, source), source)

    backend = _agreed("backend", given.get("backend", []), infos["backend"].default)
    engine = effective_backend(backend, world_size)
    options = {**(backend_options or {}).get(engine, {}), **(engine_options or {})}
    if options:
        _add_engine_options(engine, backend, options, add)

    settings: dict[str, Setting] = {}
    for path, info in infos.items():
        values = given.get(path)
        if values:
            settings[path] = Setting(_agreed(path, values, None), values[0][1])
        else:
            settings[path] = Setting(info.default, "default")
    built = _build(MixprecConfig, {p: s.value for p, s in settings.items()})
    _check_tensor_parallel(built, settings, world_size)
    return ResolvedConfig(built, settings, engine, tuple(files))


def _read_sources(config: ConfigLike, env: Mapping[str, str], add) -> list[str]:
    """Give ``add(path, value, source)`` every value of the ``MIXPREC_CONFIG_FILE`` file and
    of ``config``; returns the files read."""
    files: list[str] = []
    env_file = env.get(CONFIG_FILE_ENV)
    if env_file:
        files.append(str(Path(env_file)))
        data = load_file(env_file)
        refuse_foreign_format(data, env_file)
        for path, value in flatten(data, f"file {env_file} (${CONFIG_FILE_ENV})").items():
            add(path, value, f"file {env_file} (${CONFIG_FILE_ENV})")
    if isinstance(config, MixprecConfig):
        for path, value in flatten_object(config).items():
            add(path, value, "config object")
    elif isinstance(config, Mapping):
        for path, value in flatten(config, "config dict").items():
            add(path, value, "config dict")
    elif config is not None:
        if not isinstance(config, (str, os.PathLike)):
            raise ConfigError(
                f"config={config!r} must be a path to a YAML/JSON file, a dict, or a "
                "mixprec.config.MixprecConfig"
            )
        same = env_file and Path(env_file).resolve() == Path(config).resolve()
        if not same:
            files.append(str(config))
            data = load_file(config)
            refuse_foreign_format(data, config)
            for path, value in flatten(data, f"file {config}").items():
                add(path, value, f"file {config}")
    return files


def _check_tensor_parallel(config: MixprecConfig, settings: Mapping[str, Setting], world_size: int) -> None:
    """Tensor- and sequence-parallel groups are ``size`` consecutive ranks: the processes must
    fill whole groups. One process (a script run without a launcher, ``mixprec config
    explain``) says nothing about the run's world size and is not checked."""
    for block, what in (("tensor_parallel", "tensor"), ("sequence_parallel", "sequence")):
        size = getattr(config, block).size
        if size > 1 and world_size > 1 and world_size % size:
            raise ConfigError(
                f"{block}.size={size} (from {settings[f'{block}.size'].source}) does not "
                f"divide the world size {world_size}: {what}-parallel groups are {size} consecutive ranks "
                f"and {world_size} processes do not fill whole groups. Run a multiple of "
                f"{block}.size processes, or change {block}.size"
            )


def _agreed(path: str, values: list[tuple[Any, str]], default: Any) -> Any:
    """The one value all sources give for ``path``; a ConfigError when two differ."""
    if not values:
        return default
    first, first_source = values[0]
    for value, source in values[1:]:
        if value != first:
            raise ConfigError(
                f"config key {path!r} is given twice with different values: {format_value(first)} "
                f"by {first_source} and {format_value(value)} by {source}. Each value has one "
                "source: remove one of them (or make them equal)"
            )
    return first


def _add_engine_options(engine: str, backend: str, options: Mapping[str, Any], add) -> None:
    block = BACKEND_BLOCKS.get(engine)
    if block is None:
        raise ConfigError(
            f"engine_options={dict(options)!r} given, but backend={backend!r} runs {engine!r}, "
            f"which takes no options; options exist for {', '.join(BACKEND_BLOCKS)}"
        )
    fields = block_fields(block)
    infos = leaves(block, engine + ".")
    for key, value in options.items():
        if key not in fields:
            raise ConfigError(
                f"unknown engine option {key!r} for backend {engine!r} (config key "
                f"'{engine}.{key}').{suggest(key, fields)} Valid options: {', '.join(fields)}"
            )
        source = f"argument engine_options[{key!r}]"
        add(f"{engine}.{key}", coerce(infos[f"{engine}.{key}"], value, source), source)


def _build(cls: type, flat: dict[str, Any], prefix: str = "") -> Any:
    kwargs = {}
    for name, (tp, _default, _f) in block_fields(cls).items():
        path = f"{prefix}{name}"
        kwargs[name] = _build(tp, flat, path + ".") if is_block(tp) else flat[path]
    return cls(**kwargs)


def config_to_dict(config: MixprecConfig, only_changed: bool = True) -> dict:
    """The nested mapping of ``config`` for a YAML file (only keys differing from their
    defaults, unless ``only_changed`` is False); blocks with nothing to write are omitted."""
    from .fields import to_plain

    def walk(obj: Any, prefix: str) -> dict:
        out = {}
        for name, (tp, default, _f) in block_fields(type(obj)).items():
            value = getattr(obj, name)
            if is_block(tp):
                sub = walk(value, f"{prefix}{name}.")
                if sub:
                    out[name] = sub
            elif not only_changed or value != default:
                out[name] = to_plain(value)
        return out

    return walk(config, "")
