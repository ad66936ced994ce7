import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from harness import free_port, launch_two_nodes, retry_on_port_taken

SUPERVISION_BOUND_S = 10.0

_PRELUDE = """
import json, os, signal, sys, time
from pathlib import Path
import torch
from mixprec.distributed import init_distributed, destroy_distributed, barrier, reduce
out = Path(sys.argv[1])
state = init_distributed(torch.device("cpu"))
(out / f"pid{state.rank}").write_text(str(os.getpid()))
"""


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(_PRELUDE + textwrap.dedent(body))
    return str(path)


def _launch(*args, timeout=120, **kw):
    return subprocess.run([sys.executable, "-m", "mixprec", "launch", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def _alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _assert_all_ranks_gone(tmp_path, world):
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(world)]
    assert not [p for p in pids if _alive(p)], "a rank outlived the launcher"


def test_two_processes_run_and_see_their_env(tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text("gradient_accumulation_steps: 2\n")
    script = _script(tmp_path, """
        total = reduce(state, torch.tensor([state.rank + 1.0])).item()
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MIXPREC_CONFIG_FILE",
                "MIXPREC_BACKEND", "MIXPREC_MIXED_PRECISION")
        info = {k: os.environ.get(k) for k in keys}
        info.update(total=total, argv=sys.argv[2:], main=__name__)
        (out / f"rank{state.rank}.json").write_text(json.dumps(info))
        destroy_distributed(state)
    """)
    proc = _launch("--nproc-per-node", "2", "--config-file", str(config), "--backend", "zero2",
                   "--mixed-precision", "bf16", script, str(tmp_path), "--lr", "3")
    assert proc.returncode == 0, proc.stderr
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, info in enumerate(infos):
        assert info["RANK"] == info["LOCAL_RANK"] == str(r)
        assert info["WORLD_SIZE"] == info["LOCAL_WORLD_SIZE"] == "2"
        assert info["MASTER_ADDR"] == "127.0.0.1" and int(info["MASTER_PORT"]) > 0
        assert info["MIXPREC_CONFIG_FILE"] == str(config.resolve())
        assert (info["MIXPREC_BACKEND"], info["MIXPREC_MIXED_PRECISION"]) == ("zero2", "bf16")
        assert info["total"] == 3.0 and info["argv"] == ["--lr", "3"] and info["main"] == "__main__"


_LISTENING = """
def listening(pid):
    \"\"\"[(address, port)] of the TCP sockets process ``pid`` listens on (/proc/net/tcp{,6}).\"\"\"
    import ipaddress
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
            found.append((str(ipaddress.ip_address(raw)), int(hexport, 16)))
    return found
"""


def test_single_node_store_listens_on_loopback_only(tmp_path):
    """Issue 46, point 3: the launcher's rendezvous store (and every rank's socket) listens on
    127.0.0.1 only, at the port the ranks were given; torch's own static rendezvous would
    listen on every interface."""
    script = _script(tmp_path, _LISTENING + textwrap.dedent("""
        barrier(state)
        info = {"launcher": listening(int(os.environ["MIXPREC_LAUNCHER_PID"])), "rank": listening(os.getpid()),
                "port": int(os.environ["MASTER_PORT"]), "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}
        (out / f"listen{state.rank}.json").write_text(json.dumps(info))
        barrier(state)
        destroy_distributed(state)
    """))
    proc = _launch("--nproc-per-node", "2", script, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    for r in range(2):
        info = json.loads((tmp_path / f"listen{r}.json").read_text())
        assert [info["port"]] == [port for _, port in info["launcher"]], info  # the store, nothing else
        assert info["agent_store"] == "True", info  # the ranks joined it as clients
        for addr, port in info["launcher"] + info["rank"]:
            assert addr == "127.0.0.1", (r, addr, port, info)


def _supervised_failure(tmp_path, rank0_body: str):
    script = _script(tmp_path, f"""
        barrier(state)
        if state.rank == 1:
            time.sleep(0.5)
            (out / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        {rank0_body}
    """)
    proc = _launch("--nproc-per-node", "2", script, str(tmp_path), timeout=90)
    ended = time.time()
    killed_at = float((tmp_path / "killed_at").read_text())
    return proc, ended - killed_at


def test_sigkilled_rank_ends_the_job_and_is_named(tmp_path):
    proc, took = _supervised_failure(tmp_path, "reduce(state, torch.ones(1))")
    assert proc.returncode != 0
    assert took < SUPERVISION_BOUND_S, f"launcher ended {took:.1f}s after rank 1 was killed"
    assert "rank 1 failed first" in proc.stderr and "without a Python traceback" in proc.stderr
    assert proc.stderr.index("rank 1 failed first") < proc.stderr.find("rank 0 also failed") or "rank 0 also failed" not in proc.stderr
    _assert_all_ranks_gone(tmp_path, 2)


def test_rank_ignoring_sigterm_is_killed_within_bound(tmp_path):
    body = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n        time.sleep(300)"
    proc, took = _supervised_failure(tmp_path, body)
    assert proc.returncode != 0
    assert took < SUPERVISION_BOUND_S, f"launcher ended {took:.1f}s after rank 1 was killed"
    assert "rank 1 failed first" in proc.stderr
    _assert_all_ranks_gone(tmp_path, 2)


def test_raising_rank_traceback_is_printed_first(tmp_path):
    script = _script(tmp_path, """
        barrier(state)
        if state.rank == 1:
            raise ValueError("marker from rank one")
        reduce(state, torch.ones(1))  # loses its peer: a consequence, reported after
    """)
    proc = _launch("--nproc-per-node", "2", script, str(tmp_path), timeout=90)
    assert proc.returncode != 0
    err = proc.stderr
    assert "rank 1 failed first" in err
    first_tb = err.index("Traceback (most recent call last)")
    assert err.index("rank 1 failed first") < first_tb < err.index("ValueError: marker from rank one")
    # no other traceback comes before rank 1's
    assert err.index("ValueError: marker from rank one") < err.find("Connection closed") or "Connection closed" not in err


def test_two_nodes_on_loopback(tmp_path):
    script = _script(tmp_path, """
        total = reduce(state, torch.tensor([10.0 ** state.rank])).item()
        (out / f"rank{state.rank}.json").write_text(json.dumps([state.node_rank, state.world_size, total]))
        destroy_distributed(state)
    """)
    codes, outs = launch_two_nodes([script, str(tmp_path)], timeout=120)
    assert codes == [0, 0], outs
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [[0, 2, 11.0], [1, 2, 11.0]]


@pytest.mark.parametrize(
    "args, match",
    [
        (["--nnodes", "2", "x.py"], "needs --master-port"),
        (["--nproc-per-node", "0", "x.py"], "--nproc-per-node 0 must be >= 1"),
        (["--nnodes", "2", "--node-rank", "2", "--master-port", "1234", "x.py"], "--node-rank 2 must be in 0..1"),
        (["does_not_exist.py"], "script 'does_not_exist.py' does not exist"),
    ],
)
def test_bad_arguments_echo_the_value(tmp_path, args, match):
    (tmp_path / "x.py").write_text("")
    proc = _launch(*args, cwd=tmp_path, timeout=60)
    assert proc.returncode != 0 and match in proc.stderr


@pytest.mark.parametrize("args, env, match", [
    (["--config-file", "typo.yaml"], {}, "backend='zero22' is not supported; valid backends: .* Did you mean 'zero2'"),
    (["--backend", "zero9"], {}, r"backend='zero9' is not supported.*\(from env MIXPREC_BACKEND\)"),
    (["--config-file", "typo.yaml", "--mixed-precision", "bf16"], {"MIXPREC_MIXED_PRECISION": "fp16"},
     r"--mixed-precision bf16 conflicts with \$MIXPREC_MIXED_PRECISION=fp16 in the environment"),
    (["--config-file", "ok.yaml", "--backend", "zero3"], {},
     r"'backend' is given twice with different values: zero2 by file .*ok.yaml.* and zero3 by env MIXPREC_BACKEND"),
])
def test_config_is_checked_once_before_any_rank(tmp_path, args, env, match):
    """Issue 29, point 4: the launcher resolves the configuration the ranks would get; a typo
    or conflict is printed once and no rank starts (the script would leave a file)."""
    import re

    (tmp_path / "typo.yaml").write_text("backend: zero22\n")
    (tmp_path / "ok.yaml").write_text("backend: zero2\n")
    (tmp_path / "train.py").write_text("open('started', 'w').close()\n")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MIXPREC_")}
    proc = _launch("--nproc-per-node", "2", *args, "train.py", cwd=tmp_path, env={**full_env, **env}, timeout=60)
    assert proc.returncode != 0
    assert re.search(match, proc.stderr), proc.stderr
    assert proc.stderr.count("mixprec launch:") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) <= 3, proc.stderr
    assert not (tmp_path / "started").exists()


_TWO_NODE_FAULT = """
import sys, time
from pathlib import Path
import torch
from mixprec import Accelerator
out = Path(sys.argv[1])
acc = Accelerator(backend="zero2", mixed_precision="bf16", cpu=True)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
for step, (x, y) in enumerate(loader):
    if step == 2 and acc.process_index == 1:
        (out / "fault_at").write_text(repr(time.time()))
        raise RuntimeError("boom on node 1")
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()
"""


def _two_launchers(tmp_path, script: str, extra=(), timeout=90):
    """Start `mixprec launch --nnodes 2 --node-rank {0,1} --nproc-per-node 1` on loopback;
    return [(returncode, stderr, time it ended)] for nodes 0 and 1."""
    return retry_on_port_taken(lambda port: _two_launchers_at(port, tmp_path, script, extra, timeout))


def _two_launchers_at(port: str, tmp_path, script: str, extra, timeout):
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port, *extra]
    procs = [subprocess.Popen([sys.executable, "-m", "mixprec", "launch", *common, "--node-rank", str(n), script,
                               str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1)]
    ended = [None, None]
    deadline = time.time() + timeout
    try:
        while None in ended and time.time() < deadline:
            for n, p in enumerate(procs):
                if ended[n] is None and p.poll() is not None:
                    ended[n] = time.time()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, p.communicate()[1], t) for p, t in zip(procs, ended)]


def test_failure_on_node_1_reaches_both_launchers(tmp_path):
    """Issue 29, point 2: rank 1 (node 1) raises inside a zero2 loop while rank 0 waits in
    the gradient reduction. Both launchers print the real exception (type, message, frames,
    rank and node) as the cause within 10 s; node 0 blames no collective."""
    script = tmp_path / "train.py"
    script.write_text(_TWO_NODE_FAULT)
    results = _two_launchers(tmp_path, str(script))
    fault_at = float((tmp_path / "fault_at").read_text())
    for node, (rc, err, ended) in enumerate(results):
        assert rc == 1, (node, err)
        assert ended is not None and ended - fault_at < SUPERVISION_BOUND_S, (node, ended, fault_at, err)
        cause = err.index("[mixprec launch] FAILED: rank 1 failed first (node 1, local rank 0, pid ")
        tail = err[cause:]
        assert 'File "' in tail and "train.py\", line 15, in <module>" in tail, err
        assert "RuntimeError: boom on node 1" in tail, err
        assert "collective desync" not in err, err
    node0 = results[0][1]
    assert "node 0: rank 1 (node 1, local rank 0, pid" in node0 and "raised RuntimeError: boom on node 1 first; " \
        "stopping this node's ranks" in node0, node0


def test_a_lone_node_says_what_it_waits_for_and_gives_up(tmp_path):
    """Issue 29, point 3: node 0 started alone (and node 1 started alone, on another port)
    say what they wait for, at once, and fail clearly at --join-timeout."""
    (tmp_path / "x.py").write_text("")

    def run(port0):
        ports = [port0, str(free_port())]
        procs = [subprocess.Popen([sys.executable, "-m", "mixprec", "launch", "--nnodes", "2", "--node-rank", str(n),
                                   "--master-port", ports[n], "--join-timeout", "4", "x.py"], cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
        return ports, [p.communicate(timeout=90)[1] for p in procs], [p.returncode for p in procs]

    ports, errs, codes = retry_on_port_taken(run)
    assert codes == [1, 1], errs
    assert f"[mixprec launch] node 0: waiting for 1 of 2 nodes at 127.0.0.1:{ports[0]} (timeout 4 s, waited " in errs[0]
    assert f"[mixprec launch] node 1: waiting for node 0: nothing answers there yet at 127.0.0.1:{ports[1]} " \
           f"(timeout 4 s, waited " in errs[1]
    for n, err in enumerate(errs):
        assert (f"FAILED: node {n}: the 2 nodes did not all join at 127.0.0.1:{ports[n]} within --join-timeout 4 s"
                in err), err
        assert "Fix: start `mixprec launch` on every node with the same --nnodes 2" in err
