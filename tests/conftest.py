"""Suite-wide collection order: the files that hold `slow` tests (whole examples, notebooks,
benchmarks in subprocesses: 30 s to 3 min each) are collected first, the file with the most
slow tests first (a proxy for the longest), each file's tests kept together and in their order.
`make test` runs files on two pytest-xdist workers (--dist loadfile), which hand files out in
collection order: the long ones start at once on both workers and the short ones fill in behind
them, instead of one long file finishing alone at the end. The Makefile passes
--no-loadscope-reorder: by default pytest-xdist (>= 3.5) re-sorts the files by their number of
tests, which put the benchmark smoke run (6 tests, 3 min) last, alone on one worker. Serial runs
are unaffected but for the order."""

from collections import Counter


def pytest_collection_modifyitems(config, items):
    slow = Counter(item.path for item in items if item.get_closest_marker("slow") is not None)
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.path, i)
    items.sort(key=lambda item: (-slow[item.path], first_seen[item.path]))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _end_accelerators_after_the_test():
    """End the Accelerators a test registered in ``_helpers.END_AFTER_TEST``."""
    yield
    from _helpers import END_AFTER_TEST

    while END_AFTER_TEST:
        END_AFTER_TEST.pop().end_training()


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_outlives_its_file():
    """A test file that leaves this pytest process's default process group initialised (an
    in-process Accelerator on a backend that makes a one-process group, never ended) must
    not decide the outcome of the next file in the same xdist worker: at the end of each
    file, running Accelerators are ended and a leftover default group is destroyed."""
    yield
    import torch.distributed as dist

    from mixprec import registry

    for acc in registry.running():
        try:
            acc.end_training()
        except Exception:  # noqa: BLE001 - a half-built test Accelerator: the group below still goes
            pass
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
