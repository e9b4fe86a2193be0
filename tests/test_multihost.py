"""Multi-host training for real: two `jax.distributed` processes × four fake CPU devices on 127.0.0.1."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_cli import JAX_CACHE, in_process, xla_flags

HERE = Path(__file__).parent
DATA = HERE / "data"
ENV = {**os.environ, **JAX_CACHE, "XLA_FLAGS": xla_flags(4), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
       "JAX_PLATFORMS": "cpu"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(args_for, timeout=240, env=None):
    "Start processes 0 and 1 with args_for(i); wait for both; return their CompletedProcess-like results."
    procs = [subprocess.Popen(args_for(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENV)
             for i in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append((p.returncode, out, err))
    return results


def test_two_processes_train_together(tmp_path):
    port = free_port()
    results = run_pair(lambda i: [sys.executable, str(HERE / "multihost_worker.py"), str(tmp_path / f"p{i}.json"),
                                  f"127.0.0.1:{port}", "2", str(i)])
    for code, out, err in results:
        assert code == 0, err[-3000:]
    p0, p1 = (json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2))
    assert (p0["processes"], p0["devices"], p1["process"]) == (2, 8, 1)
    assert p0["losses"] == p1["losses"]  # one program: both processes see the same global loss
    assert p0["checksum"] == p1["checksum"]
    for a, b in zip(p0["windows"], p1["windows"]):  # each process read its own rows of every batch
        assert not set(a) & set(b)
    # the same global batch on one process with 8 devices gives the same run
    env = {**ENV, "XLA_FLAGS": xla_flags(8)}
    single = subprocess.run([sys.executable, str(HERE / "multihost_worker.py"), str(tmp_path / "one.json")],
                            capture_output=True, text=True, env=env, timeout=240)
    assert single.returncode == 0, single.stderr[-3000:]
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["losses"] == pytest.approx(p0["losses"], rel=1e-5)  # gloo sums in another order: relative to the loss
    assert sorted(sum(one["windows"], [])) == sorted(sum(p0["windows"], []) + sum(p1["windows"], []))


def test_two_processes_make_one_tokenizer_and_cache(tmp_path):
    ("Process 0 trains the tokenizer and tokenizes the data; the other receives, checks, and leaves no temporary "
     "folder. Both plan by process 0's CPU speed.")
    port, scratch = free_port(), tmp_path / "tmp"
    scratch.mkdir()
    results = run_pair(lambda i: [sys.executable, str(HERE / "multihost_worker.py"), str(tmp_path / f"p{i}.json"),
                                  f"127.0.0.1:{port}", "2", str(i), "--prepare", str(DATA / "tiny_shakespeare.txt"),
                                  str(tmp_path / "run")], env={**ENV, "TMPDIR": str(scratch)})
    for code, out, err in results:
        assert code == 0, err[-3000:]
    p0, p1 = (json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2))
    for case in ("shared", "own"):
        assert p0[case]["fingerprint"] == p1[case]["fingerprint"]  # one tokenizer...
        assert p1[case]["how"] == f"tokenizer {p0[case]['fingerprint']} received from process 0"  # ...trained once
        assert p0[case]["tokens"] == p1[case]["tokens"]  # the same training tokens on both
    assert p0["shared"]["how"].startswith("trained tokenizer") and p0["own"]["how"].startswith("trained tokenizer")
    assert p1["shared"]["data"] == p0["shared"]["data"]  # process 1 maps process 0's cache file
    assert "removed temporary file" in p1["own"]["data"]  # no shared folder: its own copy, already gone
    assert p1["own"]["files"] == []  # process 1 writes nothing of the run into its own folder
    assert p0["speed"] == p1["speed"] == 1e9  # the CPU speed measured apart (1 and 2 GFLOP/s): both plan by process 0's
    assert sorted(os.listdir(scratch)) == []  # no temporary folder left behind


def test_cli_two_processes(tmp_path):
    "tiny-lm train with --coordinator-address/--num-processes/--process-id: process 0 writes the run, both checkpoint."
    port, scratch = free_port(), tmp_path / "tmp"
    out = tmp_path / "run"
    scratch.mkdir()
    flags = ["--dataset-id", str(DATA / "tiny_shakespeare.txt"), "--vocab-size", "300", "--seq-len", "32", "--batch-size", "1",
             "--d-model", "32", "--num-layers", "1", "--num-heads", "2", "--max-steps", "6", "--eval-every", "3",
             "--save-every", "3", "--eval-batches", "2", "--no-progress", "--mesh", "data=2,fsdp=4", "--output-dir", str(out)]
    results = run_pair(lambda i: ["tiny-lm", "train", *flags, "--coordinator-address", f"127.0.0.1:{port}",
                                  "--num-processes", "2", "--process-id", str(i)], env={**ENV, "TMPDIR": str(scratch)})
    for code, _, err in results:
        assert code == 0, err[-3000:]
    (code0, out0, _), (code1, out1, _) = results
    assert "mesh: data=2 × fsdp=4 (8 devices)" in out0 and "8 × cpu on 2 processes" in out0
    for line in ("JAX ", "tokenizer", "model:", "mesh:", "compute:", "done:", "token budget"):  # only process 0 prints
        assert line in out0 and line not in out1, line  # (gloo's C++ threads write their own, sometimes interleaved, lines to both)
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["mesh"] == {"data": 2, "fsdp": 4} and summary["effective_batch_size"] == 8
    assert summary["device_info"]["process_count"] == 2
    assert (out / "checkpoint_step_6").is_dir() and (out / "metrics.jsonl").exists()
    assert sorted(os.listdir(scratch)) == []  # process 1 left no temporary folder (tokenizer or token cache)


def test_unreachable_coordinator_is_one_line(tmp_path):
    started = time.monotonic()
    r = subprocess.run(["tiny-lm", "train", "--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2",
                        "--process-id", "1", "--coordinator-timeout", "2", "--output-dir", str(tmp_path / "o")],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 2 and time.monotonic() - started < 30
    assert r.stderr.strip().count("\n") == 0 and "no coordinator answered at 127.0.0.1:" in r.stderr and "within 2 s" in r.stderr
    assert not (tmp_path / "o").exists()


def test_sigterm_to_one_process_stops_both_at_one_saved_step(tmp_path):
    "A preemption notice to one host: both processes agree on the step, save it together, and exit 143; the step restores."
    port, out = free_port(), tmp_path / "run"
    flags = ["--dataset-id", str(DATA / "tiny_shakespeare.txt"), "--vocab-size", "300", "--seq-len", "32", "--batch-size", "1",
             "--d-model", "32", "--num-layers", "1", "--num-heads", "2", "--max-steps", "2000", "--eval-every", "1000",
             "--save-every", "1000", "--save-every-minutes", "0", "--log-every", "2", "--eval-batches", "2", "--no-progress",
             "--output-dir", str(out)]
    procs = [subprocess.Popen(["tiny-lm", "train", *flags, "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
                               "--process-id", str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
             for i in range(2)]
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline, "no training steps"
        time.sleep(0.05)
    procs[0].send_signal(signal.SIGTERM)  # process 1 gets no signal
    results = [p.communicate(timeout=120) for p in procs]
    steps = []
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 143, stderr[-3000:]
        found = re.search(r"stopped by SIGTERM after step (\d+), its checkpoint saved", stderr)
        assert found, stderr[-3000:]
        steps.append(int(found.group(1)))
    assert steps[0] == steps[1] < 2000
    assert (out / f"checkpoint_step_{steps[0]}").is_dir()
    r = in_process("inspect", str(out), "--json")  # a saved step needs no start-up of its own to inspect
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["step"] == steps[0] and report["finite"]
