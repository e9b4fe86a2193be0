"""Fixtures shared by the test modules."""
import json
from pathlib import Path

import pytest
from filelock import FileLock

from test_cli import SMALL, tiny_lm, without
from test_faults import RUN, final_params, losses


def once_per_session(tmp_path_factory, name: str, build):
    """`build(folder)`'s JSON-able result, computed once for the whole test session, however many pytest-xdist
    workers share it: the first worker to ask builds it in a folder they all see, under a lock; the others wait and
    read what it left (a run folder is read-only to the tests that share it)."""
    root = tmp_path_factory.getbasetemp()
    if root.name.startswith("popen-gw"):  # an xdist worker: the session's folder is one up, shared by every worker
        root = root.parent
    folder, done = root / f"shared-{name}", root / f"shared-{name}.json"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not done.exists():
            folder.mkdir(exist_ok=True)
            done.write_text(json.dumps(build(folder)))
    return json.loads(done.read_text())


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted run of test_faults.RUN (once per session): its losses and final parameters, which every
    interrupted run must equal."""
    def build(folder: Path) -> str:
        r = tiny_lm("train", *RUN, "--output-dir", str(folder / "o"))
        assert r.returncode == 0, r.stderr
        return str(folder / "o")
    out = Path(once_per_session(tmp_path_factory, "reference", build))
    return losses(out), final_params(out)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A run of 80 steps on the Shakespeare fixture, with its sample (once per session): its folder and what it
    printed. The tests that share it only read it (or copy it)."""
    def build(folder: Path) -> dict:
        r = tiny_lm("train", *without(SMALL, "--sample-tokens"), "--max-steps", "80", "--output-dir", str(folder / "output"))
        assert r.returncode == 0, r.stderr
        return {"out": str(folder / "output"), "stdout": r.stdout}
    run = once_per_session(tmp_path_factory, "trained", build)
    return Path(run["out"]), run
