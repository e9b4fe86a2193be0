"""Fixtures shared by the test modules."""
import pytest

from test_cli import tiny_lm
from test_faults import RUN, final_params, losses


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted run of test_faults.RUN (once per test worker): its losses and final parameters, which every interrupted run must equal."""
    out = tmp_path_factory.mktemp("reference") / "o"
    r = tiny_lm("train", *RUN, "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    return losses(out), final_params(out)
