"""dispatch_batches: how much of rank 0's reading the other ranks wait for, with the
receive overlapping the next read (mixprec/data/dispatch.py) and without (``prefetch=0``).

    python benchmarks/bench_dispatch.py [--read-ms 20] [--step-ms 20] [--steps 40] [--repeats 3]

Two CPU processes over Gloo. Rank 0's loader takes ``read_ms`` per batch (a slow stream);
every rank's loop takes ``step_ms`` per batch (its training step). Without overlap an epoch
takes about ``steps * (2 * read_ms + step_ms)`` (rank 0 reads both ranks' batches, then all
step); with it about ``steps * max(2 * read_ms, step_ms)``. Prints the median epoch time of
both, measured alternately in one run, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def _epoch(state, read_ms: float, step_ms: float, steps: int, prefetch: int) -> float:
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from mixprec import Accelerator, DataLoaderConfiguration

    class SlowStream(IterableDataset):
        def __iter__(self):
            for i in range(steps * 2 * 4):
                if i % 4 == 0:
                    time.sleep(read_ms / 1000)  # one batch of 4 costs read_ms
                yield torch.full((16,), float(i))

    acc = Accelerator(cpu=True, log_policy=False, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    loader = acc.prepare(DataLoader(SlowStream(), batch_size=4))
    loader.dataloader.prefetch = prefetch
    acc.wait_for_everyone()
    start = time.perf_counter()
    for _ in loader:
        time.sleep(step_ms / 1000)  # the training step
    acc.wait_for_everyone()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--read-ms", type=float, default=20.0)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from mixprec.distributed.spawn import run_distributed

    times = {0: [], 2: []}
    for _ in range(args.repeats):
        for prefetch in (0, 2):
            t = run_distributed(_epoch, 2, args=(args.read_ms, args.step_ms, args.steps, prefetch), timeout=600)
            times[prefetch].append(max(t))
    sync, overlap = statistics.median(times[0]), statistics.median(times[2])
    print(f"read {args.read_ms:g} ms/batch on rank 0, step {args.step_ms:g} ms, {args.steps} steps, 2 processes")
    print(f"no overlap (prefetch=0): {sync:.3f} s/epoch   overlap (default): {overlap:.3f} s/epoch   "
          f"ratio {sync / overlap:.2f}x")
    print(f"ideal: no overlap {args.steps * (2 * args.read_ms + args.step_ms) / 1000:.3f} s, "
          f"overlap {args.steps * max(2 * args.read_ms, args.step_ms) / 1000:.3f} s")


if __name__ == "__main__":
    main()
