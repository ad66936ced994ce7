"""Suite-wide collection order: the files that hold a `slow` test (whole examples, notebooks,
benchmarks in subprocesses: 30 s to 3 min each) are collected first, each file's tests kept
together and in their order. `make test` runs files on two pytest-xdist workers (--dist
loadfile), which hand files out in collection order: the long ones start at once on both
workers and the short ones fill in behind them, instead of one long file finishing alone at
the end. Serial runs are unaffected but for the order."""


def pytest_collection_modifyitems(config, items):
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.path, i)
    items.sort(key=lambda item: (item.path not in slow_files, first_seen[item.path]))
