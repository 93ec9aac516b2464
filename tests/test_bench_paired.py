"""benchmarks/paired.py: the paired-rounds protocol with a peer process, checked against a stand-in
peer (a few lines of Python speaking the same protocol as vllm_decode_runner.py --paired)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks.paired import OtherCpu, PairedPeer, PeerError

PEER = textwrap.dedent('''
    import json, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    print("a log line the protocol must skip", flush=True)
    if mode == "die":
        sys.exit(3)
    if mode == "busy":                # an engine process that spins while the peer waits for "go"
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        open(out + ".child", "w").write(str(child.pid))
    print("@@evalrun ready", flush=True)
    seconds = []
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        if line.strip() == "go":
            if mode == "hang":
                time.sleep(60)
            seconds.append(0.01 * (len(seconds) + 1))
            print("noise @@evalrun not at the start", flush=True)
            print("@@evalrun " + json.dumps({"round": len(seconds) - 1, "seconds": seconds[-1]}), flush=True)
    json.dump({"round_seconds": seconds}, open(out, "w"))
''')


def _peer(tmp_path: Path, mode: str, **kw) -> PairedPeer:
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    out = tmp_path / "out.json"
    return PairedPeer([sys.executable, str(script), str(out), mode], dict(os.environ), out, **kw)


def test_rounds_answer_in_order_and_finish_writes_the_output(tmp_path):
    with _peer(tmp_path, "ok") as peer:
        assert [peer.round() for _ in range(3)] == [0.01, 0.02, 0.03]
        assert peer.finish() == {"round_seconds": [0.01, 0.02, 0.03]}
        assert peer.proc.returncode == 0


def test_a_peer_that_dies_is_reported_with_its_exit_code(tmp_path):
    with pytest.raises(PeerError, match=r"exited \(3\) before it could start its engine"):
        _peer(tmp_path, "die")


def test_a_peer_that_hangs_times_out_and_is_killed(tmp_path):
    with _peer(tmp_path, "hang", round_timeout_s=1.0) as peer:
        with pytest.raises(PeerError, match="did not finish a round within 1 s"):
            peer.round()
        proc = peer.proc
    assert proc.poll() is not None                    # closed: the hung peer is gone


def test_other_cpu_counts_another_process(tmp_path):
    """A child's CPU is another process's (os.times() of ours leaves children out). Our own work
    is not asserted to count zero: tests may run beside other processes."""
    spin = tmp_path / "spin.py"
    spin.write_text("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n")
    with OtherCpu() as busy:
        subprocess.run([sys.executable, str(spin)], check=True)
    assert busy.other_s >= 0.4
    assert busy.steal_s >= 0.0


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_paused_peer_takes_no_cpu_and_close_ends_its_processes(tmp_path):
    """The peer's engine processes (a spinning child here, as an idle vLLM-CPU engine spins) take
    no CPU while paused, run again after, and close() ends them with the peer."""
    with _peer(tmp_path, "busy") as peer:
        child = int((tmp_path / "out.json.child").read_text())
        with peer.paused():
            time.sleep(0.1)                          # the stop has landed
            before = _cpu_s(child)
            time.sleep(0.5)
            assert _cpu_s(child) - before < 0.05
        before = _cpu_s(child)
        time.sleep(0.5)
        assert _cpu_s(child) - before > 0.1          # resumed
        assert peer.round() == 0.01                  # and the peer still answers
    assert not _alive(child)
