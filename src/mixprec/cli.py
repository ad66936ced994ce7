"""The ``mixprec`` command line. Subcommands: ``env`` (versions and build flags for bug reports),
``config`` (write, ``explain``, ``reference``, ``import`` a config; see
:mod:`mixprec.config.commands`), ``test`` (a 2-process self-check; see :mod:`mixprec.selftest`),
``launch`` (start a multi-process run; see :mod:`mixprec.launch`), ``parity`` (compare
backends with an fp32 reference; see :mod:`mixprec.parity`), ``consolidate`` (one
safetensors file of full weights from a sharded checkpoint, e.g.
``mixprec consolidate runs/a/checkpoints/checkpoint_3 model.safetensors --dtype bf16``)."""

from __future__ import annotations

import argparse
import platform
import sys


def _built_cuda():
    from . import _build_torch

    return _build_torch.TORCH_CUDA


def _version_line() -> str:
    """``mixprec 0.1.0 (built against torch 2.13.0+cpu, CUDA kernels: no)``; ``mixprec env``
    gives the full picture."""
    import mixprec

    from . import _build_torch

    cuda = "yes" if mixprec.build_info()["cuda"] else "no"
    return f"mixprec {mixprec.__version__} (built against torch {_build_torch.TORCH_VERSION}, CUDA kernels: {cuda})"


def _cpu_rows() -> list:
    """The CPU facts a numerical difference between two machines is placed by: vendor and
    model, the ISA flags the kernels and torch pick by, which copy of mixprec's CPU kernels
    runs, and which fp16 matmul path ``cpu_fp16_matmul="auto"`` takes."""
    import torch

    from . import _C
    from .wrappers.half_gemm import describe

    vendor = model = ""
    flags: set = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value
                elif key == "model name" and not model:
                    model = value
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16",
              "amx_tile")
    isa = " ".join(f for f in wanted if f in flags) if flags else "unknown (no /proc/cpuinfo)"
    return [
        ("CPU", f"{vendor} {model}".strip() or platform.processor() or "unknown"),
        ("CPU ISA flags", isa),
        ("torch CPU capability", torch.backends.cpu.get_cpu_capability()),
        ("mixprec CPU kernels", _C.cpu_kernel_capability()),
        ("fp16 matmul (auto)", describe("auto")),
    ]


def _env() -> int:
    import torch

    import mixprec

    info = mixprec.build_info()
    rows = [
        ("mixprec", mixprec.__version__),
        ("python", platform.python_version()),
        ("platform", platform.platform()),
        ("torch", torch.__version__),
        ("built against torch", info["torch_version"]),
        ("built against torch CUDA", _built_cuda()),
        ("CUDA kernels built", info["cuda"]),
        ("CUDA available", torch.cuda.is_available()),
        ("torch CUDA", torch.version.cuda),
        ("Gloo available", torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        ("NCCL available", torch.distributed.is_available() and torch.distributed.is_nccl_available()),
        ("compiler", info.get("compiler", "?")),
        ("threads", torch.get_num_threads()),
        *_cpu_rows(),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    from . import _build_torch, _torch_guard

    # Reached with a mismatch only when MIXPREC_ALLOW_TORCH_MISMATCH is set (import refuses it).
    message = _torch_guard.mismatch(_build_torch.TORCH_VERSION, _build_torch.TORCH_CUDA,
                                    torch.__version__, torch.version.cuda)
    if message is not None:
        print(f"WARNING: {message}", file=sys.stderr)
        return 1
    return 0


def _consolidate(args) -> int:
    from .checkpoint import consolidate

    try:
        out = consolidate(args.checkpoint, args.out, dtype=args.dtype, model=args.model)
    except ValueError as e:
        print(f"mixprec consolidate: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mixprec", description="mixprec command line")
    parser.add_argument("--version", action="version", version=_version_line(),
                        help="print mixprec's version and the torch it was built against, then exit")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print versions, build flags and backend availability")
    from .config import commands as config_commands

    config_commands.add_arguments(sub.add_parser(
        "config", help="write a config (flags or questions); explain, reference, import",
        description="Write a mixprec YAML config from flags (one per key) or by questions. "
                    "Subcommands: explain, reference, import."))
    test = sub.add_parser("test", help="2-process self-check: ddp and zero2 in bf16 agree with a reference")
    test.add_argument("--steps", type=int, default=4, help="training steps per backend (default 4)")
    from . import launch

    launch.add_arguments(sub.add_parser("launch", help="start N processes per node (torch.distributed.run + supervision)"))
    from . import parity

    parity.add_arguments(sub.add_parser("parity", help="compare backends step by step with an fp32 reference"))
    cons = sub.add_parser("consolidate", help="write a checkpoint's full model weights to one safetensors file")
    cons.add_argument("checkpoint", help="checkpoint directory written by save_state()")
    cons.add_argument("out", help="output .safetensors file")
    cons.add_argument("--dtype", default=None, help="cast floating tensors: fp32, bf16 or fp16 (default: as saved)")
    cons.add_argument("--model", type=int, default=0, help="which prepared model (default 0)")
    args = parser.parse_args(argv)
    if args.command == "env":
        return _env()
    if args.command == "config":
        return config_commands.run(args)
    if args.command == "test":
        from . import selftest

        return selftest.main(steps=args.steps)
    if args.command == "launch":
        return launch.run_launch(args)
    if args.command == "parity":
        return parity.run_cli(args)
    if args.command == "consolidate":
        return _consolidate(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
