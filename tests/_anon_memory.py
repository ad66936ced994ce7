"""Anonymous resident memory as the OS reports it, sampled while a block runs: the probe the
memory tests of pretrained loading and streamed saving share (tests/distributed/
test_pretrained_load.py, test_streaming_save.py).

``RssAnon`` (/proc/self/status) counts a process's anonymous pages: its tensors, not the page
cache of a memory-mapped checkpoint. The sampler reads it every 5 ms from a thread; the heap
is trimmed first, so memory freed before the block does not hide growth inside it."""

from __future__ import annotations

import threading


def anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status: this measurement needs Linux procfs")


class AnonPeak:
    """Largest RssAnon sample (5 ms period) while the block runs, minus the one before it
    (``growth``, bytes)."""

    def __enter__(self) -> AnonPeak:
        from mixprec.parallel.materialize import trim_heap

        trim_heap()
        self.base = self.peak = anon_bytes()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, anon_bytes())

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, anon_bytes())
        self.growth = self.peak - self.base
