"""The ``mixprec config`` subcommands: write (by flags or questions), ``explain``,
``reference`` and ``import``.

Example::

    mixprec config --backend zero3 --mixed-precision bf16 --gradient-clipping 1.0 -o mixprec.yaml
    mixprec config explain mixprec.yaml
    mixprec config import ds_config.json -o mixprec.yaml
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from .fields import ConfigError, FieldInfo, coerce, describe_type, format_value, to_plain
from .resolve import all_leaves, resolve

_QUESTIONS = ("backend", "mixed_precision", "gradient_accumulation_steps", "gradient_clipping")


def flag_name(path: str) -> str:
    """``zero3.reshard_after_forward`` -> ``--zero3-reshard-after-forward``."""
    return "--" + path.replace(".", "-").replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``config`` parser: one flag per config key, and the subcommands."""
    parser.add_argument("-o", "--output", default="mixprec.yaml", metavar="F",
                        help="file to write (default mixprec.yaml; '-' prints it)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output file")
    parser.add_argument("--interactive", action="store_true",
                        help="ask questions (the default on a terminal when no key flag is given)")
    keys = parser.add_argument_group("config keys (see docs/configuration.md)")
    for path, info in all_leaves().items():
        keys.add_argument(flag_name(path), dest=f"key:{path}", default=None, metavar="V",
                          help=f"{info.rule or describe_type(info.type)} (default {format_value(info.default)})")
    sub = parser.add_subparsers(dest="config_command")
    ex = sub.add_parser("explain", help="the resolved config, each value's source, and the precision per backend")
    ex.add_argument("file", nargs="?", default=None, help="config file (default: $MIXPREC_CONFIG_FILE, if set)")
    ex.add_argument("--model", dest="tp_model", default=None, metavar="PATH",
                    help="a Hugging Face config.json (or its directory): also print the tensor-parallel plan, "
                         "parameter by parameter, for tensor_parallel.size (the model is built on the meta device)")
    ref = sub.add_parser("reference", help="print (or write) docs/configuration.md, generated from the schema")
    ref.add_argument("-o", "--output", dest="sub_output", default="-", metavar="F", help="file to write ('-': print, the default)")
    imp = sub.add_parser("import", help="convert a DeepSpeed JSON or Accelerate YAML config")
    imp.add_argument("file", help="the DeepSpeed .json or Accelerate .yaml config")
    imp.add_argument("-o", "--output", dest="sub_output", default="-", metavar="F", help="mixprec YAML to write ('-': print, the default)")
    imp.add_argument("--drop-refused", action="store_true",
                     help="write the config without the refused keys (default: write nothing when a key is refused)")
    imp.add_argument("--force", dest="sub_force", action="store_true", help="overwrite an existing output file")


def run(args: argparse.Namespace, input_fn: Callable[[str], str] = input) -> int:
    """Run a parsed ``mixprec config ...`` command; the exit code."""
    try:
        if args.config_command == "explain":
            return _explain(args.file, getattr(args, "tp_model", None))
        if args.config_command == "reference":
            from .reference import reference_markdown

            return _write(reference_markdown(), args.sub_output, force=True)
        if args.config_command == "import":
            return _import(args)
        return _write_config(args, input_fn)
    except ConfigError as e:
        print(f"mixprec config: error: {e}", file=sys.stderr)
        return 1


def _explain(file: Optional[str], model_path: Optional[str] = None) -> int:
    from .explain import explain

    world = int(os.environ.get("WORLD_SIZE", "1"))
    resolved = resolve(file, world_size=world)
    print(explain(resolved, world_size=world))
    if model_path is not None:
        print()
        print(_tp_plan_text(resolved.config.tensor_parallel, model_path))
    return 0


def _tp_plan_text(tp_config, model_path: str) -> str:
    """The plan ``tensor_parallel`` gives the Hugging Face model of ``model_path``, per
    parameter (split style, dimension, local shape at tensor_parallel.size, or replicated)."""
    import torch

    from ..parallel.tensor.plan import PlanError, resolve_plan

    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise ConfigError(f"--model {model_path!r} needs transformers installed ({e})") from None
    try:
        hf_config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {model_path!r}: not a Hugging Face config.json or a directory holding one ({e})") \
            from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    size = tp_config.size
    try:
        plans = resolve_plan(model, tp_config)
    except PlanError as e:
        raise ConfigError(f"tensor-parallel plan of {model_path!r}: {e}") from None
    lines = [f"tensor-parallel plan of {type(model).__name__} ({hf_config.model_type}) at tensor_parallel.size={size}:"]
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        plan = plans.get(module)
        dim = plan.split_dim() if plan is not None else None
        if plan is None or dim is None or (name.endswith(".bias") and dim != 0):
            what = "replicated" if plan is None or plan.style in ("replicated", "default") or dim is None \
                else f"replicated (bias of a {plan.style} layer, added once)"
            lines.append(f"  {name} {list(p.shape)}: {what}")
            continue
        kv = getattr(hf_config, "num_key_value_heads", None)
        if kv and size > kv and module.rpartition(".")[2] in ("k_proj", "v_proj", "key", "value"):
            lines.append(f"  {name} {list(p.shape)}: whole on every rank ({kv} key/value head(s) < {size} TP "
                         "ranks: each rank reads its head, gradients summed over TP)")
            continue
        local = list(p.shape)
        local[dim] //= size
        lines.append(f"  {name} {list(p.shape)}: {plan.describe()} -> {local} per rank")
    return "\n".join(lines)


def _write(text: str, output: str, force: bool) -> int:
    if output == "-":
        sys.stdout.write(text)
        return 0
    out = Path(output)
    if out.exists() and not force:
        print(f"mixprec config: error: {output!r} exists; pass --force to overwrite it", file=sys.stderr)
        return 1
    out.write_text(text)
    print(f"wrote {output}")
    return 0


def _dump(config: dict) -> str:
    import yaml

    def plain(node):
        return {k: plain(v) for k, v in node.items()} if isinstance(node, dict) else to_plain(node)

    return yaml.safe_dump(plain(config), sort_keys=False)


def _nest(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        *blocks, leaf = path.split(".")
        for b in blocks:
            node = node.setdefault(b, {})
        node[leaf] = value
    return out


def _write_config(args: argparse.Namespace, input_fn: Callable[[str], str]) -> int:
    infos = all_leaves()
    flat = {}
    for path, info in infos.items():
        raw = getattr(args, f"key:{path}")
        if raw is not None:
            flat[path] = coerce(info, raw, f"flag {flag_name(path)}", text=True)
    if args.interactive or (not flat and sys.stdin.isatty()):
        flat.update(ask(infos, flat, input_fn))
    config = _nest(flat)
    resolve(config, env={})  # the whole file must resolve (types, ranges)
    return _write(_dump(config), args.output, args.force)


def ask(infos: dict[str, FieldInfo], given: dict, input_fn: Callable[[str], str] = input) -> dict:
    """Questions for the main keys (and, on request, the chosen backend's block); an empty
    answer keeps the default and writes nothing. Invalid answers are asked again."""
    answers: dict = {}

    def question(path: str) -> None:
        info = infos[path]
        while True:
            raw = input_fn(f"{path} ({info.rule or describe_type(info.type)}) [{format_value(info.default)}]: ").strip()
            if not raw:
                return
            try:
                answers[path] = coerce(info, raw, "your answer", text=True)
                return
            except ConfigError as e:
                print(f"  {e}")

    for path in _QUESTIONS:
        if path not in given:
            question(path)
    backend = answers.get("backend", given.get("backend", "auto"))
    block = [p for p in infos if p.startswith(f"{backend}.")]
    if block and input_fn(f"set {backend} options? [y/N]: ").strip().lower() in ("y", "yes"):
        for path in block:
            if path not in given:
                question(path)
    return answers


def _import(args: argparse.Namespace) -> int:
    from .importers import import_config

    report = import_config(args.file)
    print(report.text(), file=sys.stderr)
    if report.refused and not args.drop_refused:
        print("mixprec config import: nothing written: fix or remove the REFUSED keys, or pass "
              "--drop-refused to write the config without them", file=sys.stderr)
        return 1
    return _write(_dump(report.config), args.sub_output, args.sub_force)
