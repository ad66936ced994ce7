"""``generate()`` and eval forwards on weights whose forward runs collectives (issue #47 point
4; [Note: generate() on sharded weights] in src/mixprec/parallel/generation.py), 2 processes
over Gloo, a tiny Llama (seed 0, fp32: ``mixed_precision="no"``, so tokens are comparable).

- zero3 and fsdp: each rank generates greedily from its own prompt (other lengths, other
  ``max_new_tokens``), without passing ``synced_gpus``, as Seq2SeqTrainer and transformers'
  summarization scripts do; the tokens equal one process's plain ``generate()`` on the same
  weights. That used to stop at the next collective with CollectiveDesyncError: the rank done
  first left while the other gathered a unit. An eval forward (``torch.no_grad``) at another
  sequence length on each rank equals one process's logits. ddp and zero2 (no collective in
  forward) are left unmarked and generate the same way.
- tensor parallelism (TP=2, one TP group): the same prompt on both ranks, no ``synced_gpus``:
  the reference tokens. Different inputs in one TP group after the first forward are an
  InputMismatchError on both ranks (they used to abort the process in Gloo, or silently give
  rank 1 rank 0's logits), so is ``generate()`` with another ``max_new_tokens`` on one rank.
- ``generate()`` on one rank only is still the watchdog's named desync.
"""

import re
from pathlib import Path

import pytest
from harness import RankFailedError, run_distributed

pytest.importorskip("transformers")

# collective_timeout: a rank left waiting is named within seconds, not after Gloo's 30 minutes
# (10 s where nothing should wait: room for a loaded machine; 3 s for the desync case).
TIMEOUT_S = 10
DESYNC_TIMEOUT_S = 3
EXIT_CODE = 87  # mixprec.distributed.watchdog.EXIT_CODE
SHARDED = ("zero3", "fsdp")
UNMARKED = ("ddp", "zero2")
# Each rank's own prompt and max_new_tokens: other prompt lengths, other generation lengths.
PROMPTS = (([5, 6, 7], 3), ([9, 3, 11, 4, 20, 8], 9))
EVAL_LENGTHS = (4, 7)


def _llama():
    """One process's model, the same on every rank (seed 0). No EOS token: every generation
    runs its whole max_new_tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=None, attn_implementation="sdpa")).eval()


def _generate(model, prompt, new):
    import torch

    return model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0)[0].tolist()


def _eval_ids(length):
    import torch

    return (torch.arange(length) * 7 % 61 + 3).reshape(1, -1)


def _accelerator(backend, config=None, timeout_s=TIMEOUT_S):
    from mixprec import Accelerator

    return Accelerator(mixed_precision="no", backend=backend, cpu=True, log_policy=False,
                       config={"collective_timeout": timeout_s, **(config or {})},
                       **({"engine_options": {"units": ["LlamaDecoderLayer"]}} if backend in SHARDED else {}))


def _data_parallel(state):
    import torch
    from transformers.distributed.fsdp import is_fsdp_managed_module

    rank = state.rank
    ref = _llama()
    prompt, new = PROMPTS[rank]
    ids = _eval_ids(EVAL_LENGTHS[rank])
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits
    out = {"ref": _generate(ref, prompt, new)}
    for backend in SHARDED + UNMARKED:
        acc = _accelerator(backend)
        model = acc.prepare(_llama())
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        tokens = _generate(acc.unwrap_model(model), prompt, new)  # synced_gpus not passed
        acc.wait_for_everyone()  # before: the rank done first was named here (desync)
        # Every module is marked: a PEFT model's generate() is its inner model's.
        marked = {is_fsdp_managed_module(m) for m in model.modules()}
        out[backend] = {"marked": marked, "tokens": tokens,
                        "logits_shape": tuple(logits.shape),
                        "logits_diff": float((logits - ref_logits).abs().max())}
        acc.end_training()
    return out


def test_generate_and_eval_at_different_lengths_per_rank():
    """zero3/fsdp marked (transformers syncs generate() itself), ddp/zero2 not; on each, every
    rank's own generation and eval forward equal one process's."""
    for rank, out in enumerate(run_distributed(_data_parallel, 2, timeout=120)):
        prompt, new = PROMPTS[rank]
        assert len(out["ref"]) == len(prompt) + new
        for backend in SHARDED + UNMARKED:
            got = out[backend]
            assert got["marked"] == {backend in SHARDED}, (rank, backend, got)
            assert got["tokens"] == out["ref"], (rank, backend, got["tokens"], out["ref"])
            assert got["logits_shape"] == (1, EVAL_LENGTHS[rank], 64)
            assert got["logits_diff"] <= 1e-5, (rank, backend, got["logits_diff"])


def _error(fn):
    """(type name, message) of what ``fn`` raised, or ("none", its result)."""
    try:
        return "none", fn()
    except Exception as e:  # noqa: BLE001 - returned to the test, which names what it wanted
        return type(e).__name__, str(e)


def _tensor_parallel(state):
    import torch
    from transformers.distributed.fsdp import is_fsdp_managed_module

    rank = state.rank
    ref = _llama()
    prompt, new = PROMPTS[0]  # one TP group: the same prompt on both ranks
    out = {"ref": _generate(ref, prompt, 6), "ref_short": _generate(ref, prompt, new)}
    acc = _accelerator("ddp", {"tensor_parallel": {"size": 2}})
    model = acc.prepare(_llama())
    gen = acc.unwrap_model(model)
    out["marked"] = {is_fsdp_managed_module(m) for m in model.modules()}
    out["tokens"] = _generate(gen, prompt, 6)  # synced_gpus not passed
    ids = _eval_ids(EVAL_LENGTHS[0])
    with torch.no_grad():
        out["logits_diff"] = float((model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max())
        # Different inputs in one TP group, after the first forward (checked at every
        # forward without grad): equal shapes with other values, then other lengths.
        out["other_values"] = _error(lambda: model(input_ids=(ids + rank) % 64).logits.sum().item())
        out["other_lengths"] = _error(lambda: model(input_ids=_eval_ids(EVAL_LENGTHS[rank])).logits.sum().item())
    acc.wait_for_everyone()
    # generate() with another max_new_tokens on one TP rank: under synced_gpus rank 0, done
    # after 3 tokens, feeds its last token again while rank 1 feeds its 4th.
    out["other_max_new_tokens"] = _error(lambda: _generate(gen, prompt, 3 + 3 * rank))
    out["after"] = _generate(gen, prompt, 6)  # the model still generates the same afterwards
    acc.wait_for_everyone()
    acc.end_training()
    # Sequence parallelism's forward runs all-to-alls: marked too (ddp over SP=2).
    acc = _accelerator("ddp", {"sequence_parallel": {"size": 2}})
    out["sp_marked"] = {is_fsdp_managed_module(m) for m in acc.prepare(_llama()).modules()}
    acc.end_training()
    return out


def test_generate_under_tensor_parallelism():
    """TP=2 (both ranks one TP group; ddp over DP=1): marked; the same prompt on both ranks,
    without passing synced_gpus, generates one process's tokens; an eval forward equals one
    process's logits. Different inputs after the first forward (other values, other lengths,
    generate() with another max_new_tokens on one rank) raise InputMismatchError on both
    ranks, naming them and their shapes, and the model generates correctly afterwards. SP
    models are marked too."""
    for rank, out in enumerate(run_distributed(_tensor_parallel, 2, timeout=120)):
        assert out["marked"] == out["sp_marked"] == {True}, out
        assert out["tokens"] == out["after"] == out["ref"], out
        assert out["logits_diff"] <= 1e-5, out["logits_diff"]
        # Rank 0's repeated token differs from rank 1's 4th: the check has something to see.
        assert out["ref_short"][-1] != out["ref"][len(out["ref_short"])], out
        for case, shapes in (("other_values", "input_ids (1, 4) (the same shapes: other values)"),
                             ("other_lengths", "rank 0: input_ids (1, 4); rank 1: input_ids (1, 7)"),
                             ("other_max_new_tokens", "the same shapes: other values")):
            kind, message = out[case]
            assert kind == "InputMismatchError", (rank, case, kind, message)
            assert "the ranks [0, 1] of one tensor-parallel group got different inputs" in message, message
            assert shapes in message, (case, message)
            assert "max_new_tokens" in message and "[Note: generate() on sharded weights]" in message
        assert "forward #" in out["other_max_new_tokens"][1]


def test_the_mark_is_true_in_eager_code_and_unseen_by_torch_compile():
    """One process: transformers reads the mark as true; Dynamo, which reads the same
    attribute to treat a module as FSDP-managed (plain True: it refuses the module, so a
    compiled prepared model would run eagerly), sees an ordinary module and traces it whole.
    Copies (an EMA model gathers nothing) and pickles do not carry it."""
    import copy
    import pickle

    import torch
    from transformers.distributed.fsdp import is_fsdp_managed_module

    from mixprec.parallel.generation import ATTR, CollectiveForward

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    mark = CollectiveForward(("zero3 unit gathers",))
    for m in model.modules():  # as mark_collective_forward does
        setattr(m, ATTR, mark)
    assert is_fsdp_managed_module(model)
    assert "zero3 unit gathers" in repr(getattr(model, ATTR))
    x = torch.randn(3, 4)
    try:
        compiled = torch.compile(model, backend="eager", fullgraph=True)  # a graph break would raise
        assert torch.equal(compiled(x), model(x))
    finally:
        torch._dynamo.reset()
    assert getattr(copy.deepcopy(model), ATTR) is False
    assert getattr(pickle.loads(pickle.dumps(model)), ATTR) is False
    assert is_fsdp_managed_module(model)  # the original keeps it


def _generate_on_rank0_only(state, report: str):
    import sys

    from mixprec import CollectiveDesyncError

    acc = _accelerator("zero3", timeout_s=DESYNC_TIMEOUT_S)
    model = acc.prepare(_llama())
    if state.rank == 0:
        # The watchdog prints its verdict on stderr before it stops this rank (rank 1, which
        # raises it, may be stopped by the harness before it could write it anywhere).
        saved, sys.stderr = sys.stderr, open(report, "w", buffering=1)  # noqa: SIM115
        try:
            _generate(acc.unwrap_model(model), *PROMPTS[0])  # MARK:generate
        finally:  # reached only when the watchdog did not stop this rank (the test fails)
            sys.stderr.close()
            sys.stderr = saved
    try:
        acc.wait_for_everyone()  # MARK:wait
    except CollectiveDesyncError as e:
        return str(e)  # a result, not an error: the harness reports rank 0's end
    return "passed"


def _line(mark: str) -> str:
    for n, text in enumerate(Path(__file__).read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# MARK:{mark}"):
            return f"{__file__}:{n}"
    raise AssertionError(f"no MARK:{mark} in {__file__}")


def test_generate_on_one_rank_is_a_named_desync(tmp_path):
    """Marking the model does not hide a real desync: rank 0 generates alone (its first
    forward waits in a unit's gather), rank 1 waits in wait_for_everyone; within the
    collective_timeout the watchdog names rank 0 and its stack, rank 1 raises
    CollectiveDesyncError and rank 0 is stopped with the watchdog's exit code."""
    report = tmp_path / "rank0_stderr.txt"
    with pytest.raises(RankFailedError, match=f"rank 0 of 2 died with exit code {EXIT_CODE}"):
        run_distributed(_generate_on_rank0_only, 2, args=(str(report),), timeout=60)
    message = report.read_text()
    assert f"[mixprec rank 0] collective desync, stopping this rank (exit code {EXIT_CODE})" in message, message
    assert re.search(rf"rank 1 waited [\d.]+ s \(collective_timeout {DESYNC_TIMEOUT_S} s\) in wait_for_everyone\(\) at "
                     rf"{re.escape(_line('wait'))}", message), message
    assert "rank 0: not in any collective" in message, message
    stack = message.split("rank 0: not in any collective")[1]
    assert f'line {_line("generate").rsplit(":", 1)[1]}, in _generate_on_rank0_only' in stack, message
    # rank 0 waits in generate()'s first gather (its root unit's, on entry: [Note: the root
    # unit during generate()] in src/mixprec/parallel/generation.py)
    assert "model.generate(" in stack, message
    assert "blamed: rank(s) [0]" in message, message
