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
