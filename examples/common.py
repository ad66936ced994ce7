"""Command-line options and set-up shared by the example scripts.

Every example runs on every backend by changing only its configuration::

    python examples/digits_cnn.py                                    # one process
    mixprec launch --nproc-per-node 2 examples/digits_cnn.py --config zero2.yaml
    mixprec launch --nproc-per-node 2 examples/digits_cnn.py --backend fsdp --mixed-precision bf16

``--config PATH`` is handed to ``Accelerator(config=PATH)``; ``--backend`` and
``--mixed-precision`` are passed as keyword arguments only when given, so a config file
(or the ``MIXPREC_BACKEND`` / ``MIXPREC_MIXED_PRECISION`` environment variables) decides
otherwise.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from tqdm import tqdm

from mixprec import Accelerator
from mixprec.logging import RANK_FORMAT, get_logger


def add_common_arguments(parser: argparse.ArgumentParser, *, steps: int) -> argparse.ArgumentParser:
    """``--config``, ``--backend``, ``--mixed-precision``, ``--steps``, ``--output-dir``, ``--seed``."""
    parser.add_argument("--config", default=None, metavar="PATH",
                        help="mixprec config file, passed as Accelerator(config=PATH)")
    parser.add_argument("--backend", default=None,
                        choices=["auto", "single", "ddp", "zero1", "zero2", "zero3", "fsdp"],
                        help="training backend (default: from --config / environment, else auto)")
    parser.add_argument("--mixed-precision", default=None, choices=["no", "bf16", "fp16", "bf16-pure"],
                        help="precision policy (default: from --config / environment, else no)")
    parser.add_argument("--steps", type=int, default=steps, help=f"optimizer steps (default {steps})")
    parser.add_argument("--output-dir", default=None, metavar="DIR",
                        help="save the final training state here (accelerator.save_state)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def make_accelerator(args: argparse.Namespace, **kwargs: Any) -> Accelerator:
    """An Accelerator from the command line: only the options given are passed."""
    if args.steps < 1:
        raise SystemExit(f"--steps {args.steps} must be >= 1")
    if args.config is not None:
        kwargs["config"] = args.config
    if args.backend is not None:
        kwargs["backend"] = args.backend
    if args.mixed_precision is not None:
        kwargs["mixed_precision"] = args.mixed_precision
    return Accelerator(**kwargs)


def setup_logging(name: str) -> logging.LoggerAdapter:
    """Log INFO records with their rank; return the example's rank-aware logger."""
    logging.basicConfig(format=RANK_FORMAT, level=logging.INFO)
    return get_logger(name)


def progress(accelerator: Accelerator, total: int, desc: str) -> tqdm:
    """A progress bar drawn by the main process only."""
    return tqdm(total=total, desc=desc, disable=not accelerator.is_main_process, dynamic_ncols=True)
