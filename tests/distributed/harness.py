"""The test suite's multi-process harness: mixprec's own local process runner.

``run_distributed(fn, world_size, args=...)`` runs ``fn(state, *args)`` on spawned ranks over
Gloo and returns their results in rank order (see ``mixprec.distributed.spawn``).
"""

from mixprec.distributed.spawn import RankFailedError, free_port, run_distributed

__all__ = ["RankFailedError", "free_port", "run_distributed"]
