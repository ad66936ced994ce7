"""benchmarks/bench_checkpoint_io.py's ``--cold`` modes ([Note: cold loads and free page
reporting] there): which waits each mode makes around the page-cache drop, against a fake
``/sys/module/page_reporting`` whose pass counter the test advances, and none where the
kernel does not report free pages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_checkpoint_io as bench  # noqa: E402


class FakeKernel:
    """A reporting kernel whose pass counter moves on the given polls, and the clock."""

    def __init__(self, folder: Path, passes_on_poll: set) -> None:
        self.folder, self.passes_on_poll = folder, passes_on_poll
        self.polls, self.passes, self.now, self.events = 0, 7, 0.0, []
        folder.mkdir(parents=True)
        self._write()

    def _write(self) -> None:
        (self.folder / "passes").write_text(f"{self.passes}\n")

    def read_passes(self):
        self.polls += 1
        if self.polls in self.passes_on_poll:
            self.passes += 1
            self._write()
            self.events.append("pass")
        return real_passes()

    def sleep(self, s: float) -> None:
        self.now += s

    def monotonic(self) -> float:
        return self.now


real_passes = bench._reporting_passes


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    def make(passes_on_poll=()):
        k = FakeKernel(tmp_path / "page_reporting", set(passes_on_poll))
        monkeypatch.setattr(bench, "REPORTING", k.folder)
        monkeypatch.setattr(bench, "_reporting_passes", k.read_passes)
        monkeypatch.setattr(bench.time, "sleep", k.sleep)
        monkeypatch.setattr(bench.time, "monotonic", k.monotonic)
        monkeypatch.setattr(bench, "drop_cache", lambda folder: k.events.append("drop"))
        return k
    return make


def test_between_passes_drops_right_after_a_pass_ends(kernel, tmp_path):
    k = kernel(passes_on_poll={40})
    bench.cold_drop(tmp_path, "between-passes")
    assert k.events == ["pass", "drop"]
    assert k.polls == 40  # it stopped polling at the pass and dropped at once


def test_between_passes_gives_up_after_3_s_without_a_pass(kernel, tmp_path):
    k = kernel()
    bench.cold_drop(tmp_path, "between-passes")
    assert k.events == ["drop"]
    assert 3.0 <= k.now < 3.01  # the fake clock: 1 ms polls for 3 s


def test_settled_drops_then_waits_until_no_pass_for_2_5_s(kernel, tmp_path):
    k = kernel(passes_on_poll={100, 1500, 2900})  # three passes about 1.4 s apart, then none
    bench.cold_drop(tmp_path, "settled")
    assert k.events == ["drop", "pass", "pass", "pass"]
    assert k.now >= 2.9 + 2.5 - 0.1  # waited out 2.5 s after the last pass


def test_immediate_drops_and_waits_for_nothing(kernel, tmp_path):
    k = kernel(passes_on_poll={1})
    bench.cold_drop(tmp_path, "immediate")
    assert k.events == ["drop"] and k.now == 0.0


def test_without_free_page_reporting_no_mode_waits(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "REPORTING", tmp_path / "absent")
    slept = []
    monkeypatch.setattr(bench.time, "sleep", slept.append)
    monkeypatch.setattr(bench, "drop_cache", lambda folder: None)
    for mode in bench.COLD_MODES:
        bench.cold_drop(tmp_path, mode)
    assert slept == []


def test_an_unknown_mode_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="between-passes.*settled.*immediate"):
        bench.cold_drop(tmp_path, "warm")
