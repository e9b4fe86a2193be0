"""Fixtures shared by the test modules: the training runs several tests read, each built once per test session.

A shared run starts in the background as soon as a test worker starts (when a collected test needs it), so the
workers run other tests while it trains, and each test module's tests that read a shared run come last. One run,
however many pytest-xdist workers: the first to start it does (under a file lock), in a folder every worker sees.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from filelock import FileLock

# Tests write only where they own the folder: what tiny_lm measures once and keeps (the CPU's speed that plans size by)
# and Hugging Face's caches go to a folder of this session, not the user's ~/.cache (tests/check.sh makes one for the
# whole run; pytest run by itself, here, before the test modules copy the environment and before xdist's workers start)
if "TINY_LM_TESTS_OWN_CACHE" not in os.environ:
    _own = tempfile.mkdtemp(prefix="tiny_lm_tests_cache.")
    os.environ.update(XDG_CACHE_HOME=f"{_own}/cache", HF_HOME=f"{_own}/huggingface", TINY_LM_TESTS_OWN_CACHE=_own)

from test_cli import ENV, SMALL, without  # noqa: E402  (after the cache folders are set)
from test_faults import RUN, SHORT, final_params, losses  # noqa: E402

# name -> the `tiny-lm` arguments of the run (its --output-dir is added)
SHARED = {
    "trained": ["train", *without(SMALL, "--sample-tokens"), "--max-steps", "80"],  # 80 steps, its sample printed
    "reference": ["train", *RUN],  # test_faults' uninterrupted run
    "faults_short": ["train", *SHORT, "20"],  # test_faults' finished run that its tests copy (a module fixture ran it
}                                             # once on each worker)
# runs the command in argv[2:], then writes its status and output to argv[1] (atomically: a reader never sees half)
RECORD = ("import json, os, subprocess, sys\n"
          "r = subprocess.run(sys.argv[2:], capture_output=True, text=True)\n"
          "record = dict(returncode=r.returncode, stdout=r.stdout, stderr=r.stderr)\n"
          "open(sys.argv[1] + '.tmp', 'w').write(json.dumps(record))\n"
          "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n")


def start(root: Path, name: str) -> None:
    """Start shared run `name` in the background, unless a worker already has."""
    with FileLock(str(root / f"{name}.lock")):
        if (root / f"{name}.started").exists():
            return
        (root / f"{name}.started").touch()
    subprocess.Popen([sys.executable, "-c", RECORD, str(root / f"{name}.json"), "tiny-lm", *SHARED[name],
                      "--output-dir", str(root / name)], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def finished(root: Path, name: str, timeout: float = 900) -> tuple[Path, dict]:
    """Shared run `name`'s folder and its record (status, stdout, stderr), once it has finished; it must have worked."""
    start(root, name)
    record, deadline = root / f"{name}.json", time.monotonic() + timeout
    while not record.exists():
        assert time.monotonic() < deadline, f"the shared run {name!r} did not finish in {timeout} s"
        time.sleep(0.2)
    run = json.loads(record.read_text())
    assert run["returncode"] == 0, run["stderr"]
    return root / name, run


@pytest.fixture(scope="session", autouse=True)
def shared_runs(request, tmp_path_factory, worker_id) -> Path:
    """The folder of the session's shared runs (pytest's temporary folder for this session, which every xdist worker
    sees); starts each run a collected test needs."""
    root = tmp_path_factory.getbasetemp()
    root = root if worker_id == "master" else root.parent
    for name in SHARED:
        if any(name in getattr(item, "fixturenames", ()) for item in request.session.items):
            start(root, name)
    return root


# modules of quick checks (no training run): last, so that no worker is left alone with a long test at the end
QUICK = {"tests/test_colab_cell.py", "tests/test_readme.py", "tests/test_notebooks.py"}


def pytest_collection_modifyitems(items):
    """In each module, the tests that read a shared run after the others (stable otherwise): a worker starts on the
    others while the shared runs train. The QUICK modules last. Every worker sorts the same collection the same way."""
    module = lambda item: item.nodeid.split("::")[0]
    first = {}
    for i, item in enumerate(items):
        first.setdefault(module(item), i)
    items.sort(key=lambda item: (module(item) in QUICK, first[module(item)],
                                 any(n in getattr(item, "fixturenames", ()) for n in SHARED)))


@pytest.fixture(scope="session")
def trained(shared_runs):
    """A run of 80 steps on the Shakespeare fixture, with its sample: its folder and its record (`stdout`). Tests only
    read it (or copy it)."""
    return finished(shared_runs, "trained")


@pytest.fixture(scope="session")
def faults_short(shared_runs) -> Path:
    """test_faults' finished run of SHORT 20 (checkpoints 15 and 20 kept); tests change copies of it, never the run."""
    return finished(shared_runs, "faults_short")[0]


@pytest.fixture(scope="session")
def reference(shared_runs):
    """The uninterrupted run of test_faults.RUN: its losses and final parameters, which every interrupted run must
    equal."""
    out, _ = finished(shared_runs, "reference")
    return losses(out), final_params(out)


@pytest.fixture(scope="session")
def cpu_timed(tmp_path_factory) -> None:
    """This CPU's training speed timed before a test's clock starts. A user's first plan with a time budget times it
    (about 10 s, 05a_cpu_speed's `cpu_train_flops`) inside that budget, once per machine and count of devices; a test
    of a 20 s budget would otherwise measure the timing, not the run. `tiny-lm plan` in a process with ENV's devices
    times it (or finds it timed: one process at a time, the others wait for its figure)."""
    r = subprocess.run(["tiny-lm", "plan", "--time-budget", "1m", "--output-dir", str(tmp_path_factory.mktemp("plan"))],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr

