"""The ``mixprec`` command line. Subcommands: ``env`` (versions and build flags for bug reports)."""

from __future__ import annotations

import argparse
import platform
import sys


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
        ("CUDA kernels built", info["cuda"]),
        ("CUDA available", torch.cuda.is_available()),
        ("torch CUDA", torch.version.cuda),
        ("Gloo available", torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        ("NCCL available", torch.distributed.is_available() and torch.distributed.is_nccl_available()),
        ("compiler", info.get("compiler", "?")),
        ("threads", torch.get_num_threads()),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if info["torch_version"].split("+")[0] != torch.__version__.split("+")[0]:
        print(
            f"WARNING: mixprec._C was built against torch {info['torch_version']} but torch "
            f"{torch.__version__} is installed; rebuild with: pip install --no-build-isolation .",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mixprec", description="mixprec command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print versions, build flags and backend availability")
    args = parser.parse_args(argv)
    if args.command == "env":
        return _env()
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
