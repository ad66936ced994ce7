"""Issue 29, point 6: ``accelerator.progress`` shows batches, rate, ETA, loss and skipped
steps on the main process, as a tqdm bar or as plain lines ([Note: progress without host
syncs] in src/mixprec/progress.py; the no-sync property is counted in
tests/distributed/test_host_syncs.py)."""

import io
import re

import pytest
import torch

from mixprec import Accelerator


def _setup(mixed_precision="bf16"):
    acc = Accelerator(mixed_precision=mixed_precision, cpu=True, log_policy=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)) for _ in range(5)]
    return acc, model, opt, batches


def _train(acc, model, opt, tracker, poison_at=2):
    losses = []
    for i, (x, y) in enumerate(tracker):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if i == poison_at:
            loss = loss * float("inf")  # a skipped step (bf16: non-finite gradients)
        losses.append(loss.detach().float().item())  # the test reads it; the tracker does not
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    return losses


def test_plain_lines_show_progress_rate_eta_loss_and_skips():
    acc, model, opt, batches = _setup()
    out = io.StringIO()
    tracker = acc.progress(batches, unit="samples", bar=False, every_s=0, file=out)
    losses = _train(acc, model, opt, tracker)
    lines = out.getvalue().splitlines()
    assert len(lines) == 6, lines  # one per batch (every_s=0) and the last one
    for i, line in enumerate(lines[:5]):
        m = re.fullmatch(rf"\[mixprec progress\] train: {i + 1}/5 batches \({(i + 1) * 20}%\), ([\d,]+) samples/s, "
                         rf"ETA (\d:\d\d:\d\d), loss (\S+), skipped (\d)", line)
        assert m, line
        assert int(m.group(1).replace(",", "")) > 0
        assert m.group(3) == f"{losses[i]:.4f}"  # this step's loss, from the backward snapshot
        assert int(m.group(4)) == (1 if i >= 2 else 0)
    assert lines[4].split("ETA ")[1].startswith("0:00:00")  # nothing left
    assert re.fullmatch(r"\[mixprec progress\] train: done, 5 batches in \d:\d\d:\d\d, [\d,]+ samples/s on average, "
                        rf"loss {re.escape(f'{losses[-1]:.4f}')}, skipped 1", lines[5]), lines[5]
    assert tracker.items == 20 and acc._progress is None


def test_tqdm_bar_shows_the_same_values():
    pytest.importorskip("tqdm")
    acc, model, opt, batches = _setup("fp16")
    out = io.StringIO()
    losses = _train(acc, model, opt, acc.progress(batches, bar=True, every_s=0, file=out, desc="fit"))
    text = out.getvalue().replace("\r", "\n")
    final = [ln for ln in text.splitlines() if ln.strip()][-1]
    assert final.startswith("fit: 100%") and "5/5 [" in final, final
    assert re.search(r"\d\d:\d\d<00:00", final), final  # elapsed<remaining (the ETA)
    assert re.search(r"samples/s=[\d,]+", final) and "skipped=1" in final, final  # fp16: an overflow skip
    assert f"loss={losses[-1]:.4f}" in final, final


def test_tokens_and_break_and_bad_unit():
    acc, model, opt, _ = _setup()
    batches = [{"input_ids": torch.zeros(2, 7, dtype=torch.long)} for _ in range(4)]
    out = io.StringIO()
    tracker = acc.progress(batches, unit="tokens", bar=False, every_s=3600, file=out)
    for i, _batch in enumerate(tracker):
        if i == 2:
            break  # the loop broke: the tracker still ends its display
    assert tracker.items == 3 * 14 and tracker.batches == 3
    assert out.getvalue().startswith("[mixprec progress] train: done, 3 batches in ")
    assert "tokens/s on average" in out.getvalue() and acc._progress is None
    with pytest.raises(ValueError, match=r"progress\(unit='images'\) is not one of \('samples', 'tokens', 'batches'\)"):
        acc.progress(batches, unit="images")
    with pytest.raises(ValueError, match="found no tensor with a batch dimension in a batch of type str"):
        list(acc.progress(["a", "b"], bar=False, file=io.StringIO()))
