import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def pytest_collection_modifyitems(config, items):
    # Every test in this directory starts several processes: `-m "not distributed"` (make
    # test-quick) leaves them out. This hook sees the whole session's items, hence the path test.
    for item in items:
        if str(item.path).startswith(_HERE):
            item.add_marker(pytest.mark.distributed)


def pytest_sessionfinish(session, exitstatus):
    # Stop the warm ranks of harness.run_distributed (tests/distributed/harness.py).
    harness = sys.modules.get("harness")
    if harness is not None and hasattr(harness, "close_pools"):
        harness.close_pools()
