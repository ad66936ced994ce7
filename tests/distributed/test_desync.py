"""Fault injection for collective desync detection ([Note: desync detection] in
src/mixprec/distributed/watchdog.py): each case of _desync_script.py runs on 2 processes
(plain processes with RANK/WORLD_SIZE/MASTER_* set, or `mixprec launch`) with
collective_timeout=3 s. Every case used to hang until the 30-minute Gloo timeout, abort
natively in Gloo, or end with "Connection closed by peer"; here each must end with a
message naming the call, its source line and the rank to blame, within BOUND_S (generous
for a loaded 2-core machine; the measured times are printed, run with -s)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import hosted_store, rank_env, run_distributed

SCRIPT = Path(__file__).with_name("_desync_script.py")
TIMEOUT_S = 3  # collective_timeout of the cases
BOUND_S = 60  # from the start of the processes to every rank gone
EXIT_CODE = 87  # mixprec.distributed.watchdog.EXIT_CODE
RAISED = 3  # the script's exit code after catching CollectiveDesyncError


def _line(mark: str) -> str:
    """``path:line`` of the script line carrying ``# MARK:<mark>``."""
    for n, text in enumerate(SCRIPT.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# MARK:{mark}"):
            return f"{SCRIPT}:{n}"
    raise AssertionError(f"no MARK:{mark} in {SCRIPT}")


def _run(tmp_path, case: str, timeout_s: float = TIMEOUT_S):
    """Both ranks' (exit code, output) and the wall time; fails if they outlive BOUND_S."""
    procs, files = [], []
    start = time.monotonic()
    with hosted_store() as port:
        for rank in range(2):
            env = dict(os.environ, **rank_env(rank, 2, port), OMP_NUM_THREADS="1")
            env.pop("MIXPREC_LAUNCH_DIR", None)
            f = open(tmp_path / f"{case}_rank{rank}.log", "w+")
            files.append(f)
            procs.append(subprocess.Popen([sys.executable, str(SCRIPT), case, str(timeout_s)], env=env,
                                          stdout=f, stderr=subprocess.STDOUT))
        try:
            for p in procs:
                p.wait(timeout=max(0.1, BOUND_S - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            pytest.fail(f"case {case!r} still running after {BOUND_S} s: a rank hangs")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    ended = time.time()
    outs = []
    for f in files:
        f.seek(0)
        outs.append(f.read())
        f.close()
    faults = [float(m) for out in outs for m in re.findall(r"^FAULT_AT ([\d.]+)$", out, re.M)]
    # From the later rank's arrival at the faulty part to both ranks gone.
    elapsed = ended - max(faults) if faults else float("nan")
    return [(p.returncode, out) for p, out in zip(procs, outs)], elapsed


def _detected_after(out: str) -> float:
    """Seconds from the faulty call to the raised error (the script's RESULT line)."""
    m = re.search(r"RESULT rank=\d kind=error elapsed=([\d.]+)", out)
    return float(m.group(1)) if m else float("nan")


def _assert_report(results, must: list[str], blamed: str):
    for rank, (code, out) in enumerate(results):
        assert code in (RAISED, EXIT_CODE), (rank, code, out)
        for text in must:
            assert text in out, (rank, text, out)
        assert f"blamed: rank(s) {blamed}" in out, (rank, out)


@pytest.mark.parametrize("case,backend_call,mark", [
    ("state_dict", "get_state_dict", "state_dict"),   # zero2, bf16-stored parameters
    ("gather", "gather", "gather"),                   # ddp
    ("wait", "wait_for_everyone", "wait"),            # ddp
    ("reduce", "reduce", "reduce"),                   # ddp
    ("reduce_late", "reduce", "reduce_late"),         # ddp, rank 1's verdict comes first
])
def test_collective_on_one_rank_names_both_calls_and_lines(tmp_path, case, backend_call, mark):
    """Rank 0 makes the call alone; rank 1 goes on to the next step's backward. The call is
    checked through the store before any Gloo collective (no native abort), and the report
    names rank 0's call and line and rank 1's backward and line."""
    results, elapsed = _run(tmp_path, case)
    _assert_report(results, [f"rank 0: in {backend_call}() at {_line(mark)}",
                             f"rank 1: in backward() at {_line('backward')}",
                             "ranks are in different collective calls"], "[1]")
    assert results[0][0] == RAISED  # the checked call's own thread raises on rank 0
    print(f"\n[{case}] both ranks gone {elapsed:.1f} s after the fault; rank 0 raised "
          f"{_detected_after(results[0][1]):.1f} s after the call (timeout {TIMEOUT_S} s)")


def test_clip_grad_norm_on_one_rank_zero3(tmp_path):
    results, elapsed = _run(tmp_path, "clip")
    _assert_report(results, [f"rank 0: in clip_grad_norm_() at {_line('clip')}",
                             f"rank 1: in optimizer.step() at {_line('clip_step')}"], "[1]")
    print(f"\n[clip zero3] both ranks gone {elapsed:.1f} s after the fault")


def test_clip_grad_norm_on_one_rank_under_tensor_parallelism(tmp_path):
    """TP=2 (ddp over DP=1): rank 0's clip waits in the TP group's norm all-reduce, rank 1 in
    the step's world-wide found_inf agreement; the watchdog names both calls and lines."""
    results, elapsed = _run(tmp_path, "tp_clip")
    _assert_report(results, [f"rank 0: in clip_grad_norm_() at {_line('clip')}",
                             f"rank 1: in optimizer.step() at {_line('clip_step')}"], "[1]")
    print(f"\n[clip tp] both ranks gone {elapsed:.1f} s after the fault")


def test_clip_grad_norm_on_one_rank_under_sequence_parallelism(tmp_path):
    """SP=2 (zero3 over both ranks, Ulysses all-to-alls in every forward): rank 0's clip waits
    in the norm all-reduce, rank 1 in the step's found_inf agreement; both are named."""
    results, elapsed = _run(tmp_path, "sp_clip")
    _assert_report(results, [f"rank 0: in clip_grad_norm_() at {_line('clip')}",
                             f"rank 1: in optimizer.step() at {_line('clip_step')}"], "[1]")
    print(f"\n[clip sp] both ranks gone {elapsed:.1f} s after the fault")


def test_different_calls_at_the_same_point_raise_at_once(tmp_path):
    results, elapsed = _run(tmp_path, "different")
    for code, out in results:
        assert code == RAISED, out
        assert "ranks made different collective calls at the same point" in out
        assert f"rank 0: gather() at {_line('diff0')}, tensors (3,) float32" in out
        assert f"rank 1: reduce() at {_line('diff1')}, tensors (3,) float32" in out
        assert _detected_after(out) < TIMEOUT_S  # no timeout involved
    print(f"\n[different calls] raised on both ranks {max(_detected_after(o) for _, o in results):.2f} s "
          f"after the calls")


def test_shape_mismatch_in_gather_names_ranks_and_shapes(tmp_path):
    results, elapsed = _run(tmp_path, "shapes")
    for code, out in results:
        assert code == RAISED, out  # not Gloo's native abort (exit -6)
        assert "gather() got tensors of different shapes/dtypes on different ranks" in out
        assert f"rank 0: gather() at {_line('shapes')}, tensors (4, 3) float32" in out
        assert f"rank 1: gather() at {_line('shapes')}, tensors (5, 3) float32" in out
        assert "pad_across_processes" in out
    print(f"\n[shapes] raised on both ranks {max(_detected_after(o) for _, o in results):.2f} s after the call")


def test_rank_stuck_in_python_is_blamed_with_its_stack(tmp_path):
    results, elapsed = _run(tmp_path, "stuck")
    stack_line = f'File "{SCRIPT}", line {_line("stuck").rsplit(":", 1)[1]}, in <module>'
    for code, out in results:
        assert code in (RAISED, EXIT_CODE), out
        assert "rank 1: not in any collective (last: optimizer.step #2); its main thread is at:" in out
        assert stack_line in out and "time.sleep(0.05)" in out
        assert f"rank 0: in backward() at {_line('backward')}" in out
        assert "blamed: rank(s) [1] (did not reach the collective the others wait in)" in out
    assert results[1][0] == EXIT_CODE  # stopped by the verdict while looping
    print(f"\n[stuck in Python] both ranks gone {elapsed:.1f} s after the fault (timeout {TIMEOUT_S} s)")


def test_uneven_data_then_exit_names_the_exhausted_dataloader(tmp_path):
    """even_batches=False, 5 samples: rank 0 gets 3 batches, rank 1 gets 2 and ends; rank 0's
    third backward loses its peer ("Connection closed by peer") and the error says why."""
    results, elapsed = _run(tmp_path, "uneven")
    code, out = results[0]
    assert code == RAISED, out
    assert f"rank 0 failed in backward() at {_line('uneven_backward')}" in out
    assert "Connection closed by peer" in out
    assert "rank 1: ended training; its dataloader ran out after 2 batches" in out
    assert "uneven data: rank 1's dataloader ran out after 2 batches" in out and "even_batches=True" in out
    assert "blamed: rank(s) [1]" in out
    assert results[1][0] == 0
    print(f"\n[uneven data, exit] rank 0 raised {_detected_after(out):.1f} s after the first step")


def test_uneven_data_then_wait_names_the_exhausted_dataloader(tmp_path):
    results, elapsed = _run(tmp_path, "uneven_wait")
    _assert_report(results, [f"rank 1: in wait_for_everyone() at {_line('uneven_wait')}",
                             "its dataloader ran out after 2 batches",
                             f"rank 0: in backward() at {_line('uneven_backward')}",
                             "its dataloader is at batch 3",
                             "uneven data: rank 1's dataloader ran out after 2 batches"], "[1]")
    print(f"\n[uneven data, wait] both ranks gone {elapsed:.1f} s after the fault")


def test_main_process_first_may_take_longer_than_the_timeout(tmp_path):
    """The main process sleeps 2.5x the timeout inside main_process_first: legitimate."""
    results, elapsed = _run(tmp_path, "main_first")
    for rank, (code, out) in enumerate(results):
        assert code == 0, out
        assert f"main_first ok rank={rank}" in out
        assert "collective desync" not in out
    assert elapsed > 2.5 * TIMEOUT_S


def test_a_slow_step_on_every_rank_is_not_a_desync(tmp_path):
    """Every rank spends 2x the timeout inside the same backward: reported, not stopped."""
    results, elapsed = _run(tmp_path, "slow_step")
    for rank, (code, out) in enumerate(results):
        assert code == 0, out
        assert f"slow_step ok rank={rank}" in out
        assert "no rank is missing, so this is not a desync; waiting on" in out
        assert "collective desync" not in out


def test_join_uneven_inputs_on_one_process_and_bad_joinables():
    # Uneven data across processes: tests/distributed/test_join.py.
    from mixprec import Accelerator

    acc = Accelerator(cpu=True, log_policy=False)
    with acc.join_uneven_inputs([], even_batches=False) as joined:
        assert joined == []
    with pytest.raises(TypeError, match="joins models and optimizers returned by accelerator.prepare"):
        with acc.join_uneven_inputs([object()]):
            pass


def _drop_an_accelerator(state):
    import gc
    import threading

    from mixprec import Accelerator

    acc = Accelerator(backend="ddp", cpu=True, log_policy=False)
    acc.prepare(torch_linear())
    thread = acc._watchdog._thread
    alive_before = thread.is_alive()
    del acc
    gc.collect()
    thread.join(2.0)  # it stops at its next poll (0.25 s)
    names = [t.name for t in threading.enumerate()]
    return alive_before, thread.is_alive(), names


def torch_linear():
    import torch

    return torch.nn.Linear(4, 4)


def test_a_dropped_accelerator_stops_its_watchdog_thread():
    """An Accelerator collected without end_training() (a script or test that builds several
    in turn) stops its thread, while the process group it watched is still up."""
    for alive_before, alive_after, names in run_distributed(_drop_an_accelerator, 2):
        assert alive_before and not alive_after, names
        assert "mixprec-desync-watchdog" not in names, names


def test_collective_timeout_is_validated_and_can_be_turned_off():
    from mixprec import Accelerator, ConfigError

    with pytest.raises(ConfigError, match="collective_timeout.*-1"):
        Accelerator(cpu=True, log_policy=False, config={"collective_timeout": -1})
    acc = Accelerator(cpu=True, log_policy=False, config={"collective_timeout": None})
    assert acc.config.config.collective_timeout is None and acc._watchdog is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="launcher supervision is Linux only")
@pytest.mark.parametrize("case", ["stuck", "stuck_gloo"])
def test_launcher_blames_the_stalled_rank_and_prints_its_stack(tmp_path, case):
    """stuck: rank 0's watchdog times out; stuck_gloo: the process group's 3 s timeout ends
    rank 0's backward first (detection at 60 s), and that error is diagnosed. Either way the
    launcher blames rank 1 (it used to say "rank 0 failed first")."""
    proc = subprocess.run([sys.executable, "-m", "mixprec", "launch", "--nproc-per-node", "2", str(SCRIPT),
                           case, str(TIMEOUT_S)], capture_output=True, text=True, timeout=BOUND_S + 30,
                          cwd=tmp_path)
    err = proc.stderr
    assert proc.returncode == 1, err
    summary = err[err.index("[mixprec launch] FAILED: collective desync: rank(s) [1] stopped"):]
    assert "rank 0 failed first" not in err
    assert "[mixprec launch] rank 1's stack when it was blamed:" in summary
    stack = summary.split("[mixprec launch] rank 1's stack when it was blamed:")[1]
    assert f'File "{SCRIPT}", line {_line("stuck").rsplit(":", 1)[1]}, in <module>' in stack
    assert "runpy" not in stack  # the launcher's bootstrap frames are left out
    if case == "stuck_gloo":
        assert "rank 0 failed in backward()" in summary and "Timed out waiting 3000ms" in summary


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="launcher supervision is Linux only")
def test_sigterm_to_the_launcher_blames_no_rank(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text("import os, sys, time\nopen(os.path.join(sys.argv[1], 'up' + os.environ['RANK']), 'w').close()\n"
                      "while True:\n    time.sleep(0.05)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "mixprec", "launch", "--nproc-per-node", "2", str(script),
                                 str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all((tmp_path / f"up{r}").exists() for r in range(2)):
            time.sleep(0.05)
        time.sleep(0.5)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert "failed first" not in err, err
    assert "stopped by SIGTERM sent to the launcher; every rank was terminated (no rank failed on its own)" in err


def test_signatures_compare_what_the_backend_needs_equal():
    import torch

    from mixprec.distributed.watchdog import pad_signature, tree_signature

    a = {"x": torch.ones(4, 3), "y": torch.zeros(2, dtype=torch.int64)}
    assert tree_signature(a) == "(4, 3) float32, (2,) int64"
    assert tree_signature(torch.ones(5, 3)) != tree_signature(torch.ones(4, 3))
    assert tree_signature(torch.ones(4, 3, dtype=torch.bfloat16)) == "(4, 3) bfloat16"
    # pad_across_processes: the padded dim may differ, the others may not.
    assert pad_signature(torch.ones(4, 3), 0) == pad_signature(torch.ones(7, 3), 0) == "(*, 3) float32"
    assert pad_signature(torch.ones(4, 3), 1) != pad_signature(torch.ones(5, 3), 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="launcher supervision is Linux only")
def test_launcher_prints_where_the_surviving_ranks_were(tmp_path):
    """No verdict (rank 0 raises while rank 1 loops): the launcher SIGUSR1s rank 1 at the
    failure and prints its faulthandler dump, so a stuck survivor shows where it was."""
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "flag = os.path.join(sys.argv[1], 'looping')\n"
        "def stuck_here():\n"
        "    open(flag, 'w').close()\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "if os.environ['RANK'] == '1':\n"
        "    stuck_here()\n"
        "while not os.path.exists(flag):\n"
        "    time.sleep(0.05)\n"
        "raise ValueError('rank zero fails')\n")
    proc = subprocess.run([sys.executable, "-m", "mixprec", "launch", "--nproc-per-node", "2", str(script),
                           str(tmp_path)], capture_output=True, text=True, timeout=90)
    err = proc.stderr
    assert proc.returncode == 1, err
    assert "rank 0 failed first" in err and "ValueError: rank zero fails" in err
    dump = err.split("[mixprec launch] rank 1's threads when the first failure was seen:")[1]
    assert "in stuck_here" in dump and str(script) in dump


def _peer_failure_is_quoted_not_blamed(state):
    """Rank 1 publishes a failure the way `mixprec launch`'s bootstrap does (node 1 raised)
    and never reaches the gather; rank 0 waits in the gather's store check."""
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from mixprec import Accelerator, CollectiveDesyncError, PeerFailedError
    from mixprec.distributed import rendezvous
    from mixprec.distributed.watchdog import _tcp_address

    acc = Accelerator(cpu=True, log_policy=False, config={"collective_timeout": 2})
    store = rendezvous.connect(*_tcp_address(dist.distributed_c10d._get_default_store()), timeout_s=10)
    if state.rank == 1:
        tb = 'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\nRuntimeError: boom on node 1\n'
        record = rendezvous.failure_record(rank=1, local_rank=0, node_rank=1, pid=4242,
                                           exc=RuntimeError("boom on node 1"), traceback_text=tb, reason="raised")
        assert rendezvous.publish_failure(store, record)["pid"] == 4242
        store.wait(["rank0_done"], datetime.timedelta(seconds=60))
        return None
    start = time.monotonic()
    try:
        acc.gather(torch.ones(2))
    except CollectiveDesyncError as e:  # noqa: F841 - what it used to raise
        outcome = ("desync", str(e))
    except PeerFailedError as e:
        outcome = ("peer", str(e))
    store.set("rank0_done", "1")
    return outcome + (time.monotonic() - start,)


def test_watchdog_defers_to_a_published_failure():
    """Issue 29, point 2: a failure published in the rendezvous store (by another node's
    rank) is quoted as the cause; no collective is blamed and no verdict is written."""
    from harness import run_distributed

    (kind, message, waited), none = run_distributed(_peer_failure_is_quoted_not_blamed, 2)
    assert none is None
    assert kind == "peer", message
    assert message.startswith("rank 1 (node 1, local rank 0, pid 4242) raised RuntimeError: boom on node 1 first "
                              "(published through the rendezvous store); rank 0 stopped in gather() at "), message
    assert "this is not a collective desync" in message and message.endswith("RuntimeError: boom on node 1")
    assert 'File "train.py", line 9' in message and "blamed" not in message


_BLOCKED_IN_BACKEND = """
import os, sys, time
import torch
import torch.distributed as dist
from mixprec import Accelerator
from mixprec.distributed import rendezvous
from mixprec.distributed.watchdog import _tcp_address
acc = Accelerator(backend="zero2", cpu=True, log_policy=False, config={"collective_timeout": 60})
model = torch.nn.Linear(4, 2)
model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
if acc.process_index == 1:
    store = rendezvous.connect(*_tcp_address(dist.distributed_c10d._get_default_store()), timeout_s=10)
    rendezvous.publish_failure(store, rendezvous.failure_record(
        rank=1, local_rank=0, node_rank=1, pid=os.getpid(), exc=ValueError("boom on node 1"),
        traceback_text=None, reason="raised"))
    time.sleep(60)  # never reaches the backward's reduction; the test kills it
acc.backward(model(torch.ones(3, 4)).sum())  # zero2: waits in the gradient reduction for rank 1
print("NOT REACHED", flush=True)
"""


def test_watchdog_thread_ends_a_rank_blocked_on_a_failed_peer(tmp_path):
    """The thread path: rank 0 is blocked inside the backend (no store check to raise from),
    collective_timeout is 60 s; its watchdog reads the published failure at its next poll
    and ends the rank with exit code 88, quoting the failure, not blaming a collective."""
    script = tmp_path / "blocked.py"
    script.write_text(_BLOCKED_IN_BACKEND)
    procs = []
    with hosted_store() as port:
        for rank in range(2):
            env = dict(os.environ, **rank_env(rank, 2, port), OMP_NUM_THREADS="1")
            env.pop("MIXPREC_LAUNCH_DIR", None)
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        try:
            out0 = procs[0].communicate(timeout=BOUND_S)[0]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.communicate()
    assert procs[0].returncode == 88, out0  # mixprec.distributed.watchdog.PEER_FAILED_EXIT_CODE
    assert ("[mixprec rank 0] stopping (exit code 88): rank 1 (node 1, local rank 0, pid "
            in out0 and ") raised ValueError: boom on node 1 first" in out0), out0
    assert "collective desync" not in out0 and "NOT REACHED" not in out0
