"""Faults, in real subprocesses: SIGTERM and Ctrl-C, kill -9 at any moment, a damaged newest checkpoint, a full disk,
and a run folder that is continued rather than overwritten."""
import json
import re
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from test_cli import ENV, SMALL, in_process, overwrite_with_random_bytes, tiny_lm, without

# 60 short steps, a checkpoint every 3 of them and a metrics line every step: plenty of moments to interrupt
RUN = [*without(SMALL, "--eval-every", "--save-every"), "--eval-every", "30", "--save-every", "3", "--log-every", "1",
       "--save-every-minutes", "0", "--max-steps", "60"]


def start(out: Path, *args: str, preexec_fn=None, env=ENV) -> subprocess.Popen:
    return subprocess.Popen(["tiny-lm", "train", *args, "--output-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=preexec_fn)


def logged_steps(out: Path) -> int:
    """The newest step metrics.jsonl records (0 before the first)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)


def logged_seconds(out: Path) -> float:
    """Seconds of training (`fit`'s clock, which starts after the budget's) at the newest step metrics.jsonl records."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0.0
    return max((json.loads(line).get("time", 0.0) for line in lines if line.endswith("}")), default=0.0)


def wait_until(condition, proc: subprocess.Popen, timeout: float = 180):
    """Poll `condition()` every millisecond or so until it is true; fails if the process ends first."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended first: {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def steps_on_disk(out: Path) -> list:
    return sorted(int(p.name.rsplit("_", 1)[1]) for p in out.glob("checkpoint_step_*") if re.fullmatch(r"checkpoint_step_\d+", p.name))


def losses(out: Path) -> dict:
    """(loss or val_loss, step) -> value in metrics.jsonl; a resumed run appends, and its record of a repeated step wins."""
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {(key, r["step"]): r[key] for r in records for key in ("loss", "val_loss") if key in r}


def final_params(out: Path) -> list:
    from flax import nnx
    import jax
    from tiny_lm.checkpoint import load_checkpoint
    model, _, _ = load_checkpoint(out / "checkpoint_step_60")
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


@pytest.mark.parametrize("moment", ["mid-step", "mid-save"])
def test_kill_9_then_the_same_command_equals_an_uninterrupted_run(reference, tmp_path, moment):
    out = tmp_path / "o"
    p = start(out, *RUN)
    if moment == "mid-step":
        wait_until(lambda: logged_steps(out) >= 20, p)
    else:  # the moment a step folder is being written: Orbax's temporary folder exists
        wait_until(lambda: logged_steps(out) >= 10 and any(out.glob("checkpoint_step_*.orbax-checkpoint-tmp*")), p)
    p.kill()
    p.communicate()
    assert p.returncode == -signal.SIGKILL
    assert steps_on_disk(out) and max(steps_on_disk(out)) < 60
    r = tiny_lm("train", *RUN, "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    newest = max(int(m) for m in re.findall(r"holds a run \(newest checkpoint: step (\d+)\): continuing it", r.stdout))
    assert f"resumed {out} at step {newest} of 60" in r.stdout
    ref_losses, ref_params = reference
    assert losses(out) == ref_losses  # every step's loss, bit for bit
    for a, b in zip(ref_params, final_params(out), strict=True):
        np.testing.assert_array_equal(a, b)


def test_sigterm_finishes_the_step_saves_and_exits_143(tmp_path):
    out = tmp_path / "o"
    p = start(out, *without(RUN, "--max-steps"), "--max-steps", "100000")
    wait_until(lambda: logged_steps(out) >= 12, p)
    sent = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, stderr = p.communicate(timeout=30)
    assert p.returncode == 143 and time.monotonic() - sent < 10, stderr
    last = stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"stopped by SIGTERM after step (\d+), its checkpoint saved in (.+): run the same command to continue from it", last)
    assert m and m.group(2) == str(out), last
    step = int(m.group(1))
    assert steps_on_disk(out)[-1] == step
    r = tiny_lm("train", *without(RUN, "--max-steps"), "--max-steps", str(step + 3), "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    assert f"resumed {out} at step {step} of {step + 3}" in r.stdout


def test_ctrl_c_once_saves_twice_stops_at_once(tmp_path):
    out = tmp_path / "once"
    p = start(out, *without(RUN, "--max-steps"), "--max-steps", "100000")
    wait_until(lambda: logged_steps(out) >= 8, p)
    p.send_signal(signal.SIGINT)
    _, stderr = p.communicate(timeout=30)
    assert p.returncode == 130 and "stopped by Ctrl-C after step" in stderr.strip().splitlines()[-1], stderr
    out = tmp_path / "twice"
    p = start(out, *without(RUN, "--max-steps"), "--max-steps", "100000")
    wait_until(lambda: len(steps_on_disk(out)) >= 2, p)
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGINT)
    _, stderr = p.communicate(timeout=30)
    assert p.returncode == 130, stderr
    assert "Traceback" not in stderr
    r = tiny_lm("train", *without(RUN, "--max-steps"), "--max-steps", str(steps_on_disk(out)[-1] + 2), "--output-dir", str(out))
    assert r.returncode == 0 and "continuing it" in r.stdout, r.stderr


# 20 steps, a checkpoint every 5: the finished run that the damaged-checkpoint, full-disk and folder tests each copy
SHORT = [*without(RUN, "--max-steps", "--save-every"), "--save-every", "5", "--max-steps"]


@pytest.fixture
def short_run(faults_short) -> Path:
    """A finished run of SHORT 20 (checkpoints 15 and 20 kept), trained once for every worker (conftest's shared runs);
    tests change copies of it, never the run itself."""
    return faults_short


def copy_run(run: Path, to: Path) -> Path:
    """A copy of a run folder that keeps its hard links (final_checkpoint shares its files with the newest step), as the
    run left it."""
    to.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", str(run), str(to)], check=True)
    return to


@pytest.mark.parametrize("damage", ["array files truncated", "every file random bytes, metadata included"])
def test_damaged_newest_checkpoint_falls_back_with_a_warning(short_run, tmp_path, damage):
    out = copy_run(short_run, tmp_path / "o")
    if damage == "array files truncated":
        for f in (out / "checkpoint_step_20" / "model").rglob("*"):
            if f.is_file():
                f.write_bytes(b"garbage")
    else:
        overwrite_with_random_bytes(out / "checkpoint_step_20")
    r = tiny_lm("train", *SHORT, "25", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    assert "warning: checkpoint_step_20 (" in r.stderr and "cannot be read (damaged): using step 15 instead" in r.stderr
    assert "moved the unreadable checkpoint_step_20 aside (now checkpoint_step_20.damaged)" in r.stdout
    assert f"resumed {out} at step 15 of 25" in r.stdout
    assert (out / "checkpoint_step_20.damaged").is_dir() and steps_on_disk(out)[-1] == 25


def _mounted_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode == 0
    except OSError:  # no mount command here
        return False


def test_full_disk_stops_with_one_clear_line_and_the_checkpoints_intact(short_run, tmp_path):
    """A copy of `short_run` (step 20) on a real tmpfs filled with ballast where this machine allows mounting, else under
    a real per-file size limit (RLIMIT_FSIZE), continued to step 30."""
    disk = tmp_path / "disk"
    mounted = _mounted_tmpfs(disk, "64m")
    try:
        out = copy_run(short_run, disk / "o")
        before = {s: sorted(p.name for p in (out / f"checkpoint_step_{s}").rglob("*")) for s in steps_on_disk(out)}
        if mounted:  # leave 200 KB free: room for metrics lines, not for a checkpoint
            free = shutil.disk_usage(disk).free
            (disk / "ballast").write_bytes(b"\0" * (free - 200_000))
            limit = None
        else:  # no file above 64 KB: metrics fit, a checkpoint's optimizer array files (80-130 KB) do not
            limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (64_000, 64_000))
        p = start(out, *SHORT, "30", preexec_fn=limit)
        _, stderr = p.communicate(timeout=300)
        assert p.returncode == 2, stderr
        ours = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert len(ours) == 1 and "The earlier checkpoints are intact" in ours[0], stderr
        reason = "the disk is full" if mounted else "the save did not complete"  # refused before writing / failed inside Orbax's save
        assert re.match(rf"error: cannot write the checkpoint of step (25|30) in {re.escape(str(out))}: {reason}", ours[0]), ours[0]
        if mounted:
            assert stderr.strip() == ours[0], stderr  # refused before writing: no noise from half a save
        assert {s: sorted(p.name for p in (out / f"checkpoint_step_{s}").rglob("*")) for s in before} == before
        (disk / "ballast").unlink(missing_ok=True)
        r = tiny_lm("train", *SHORT, "30", "--output-dir", str(out))  # with room again, the same command continues
        assert r.returncode == 0, r.stderr
        assert f"resumed {out} at step 20 of 30" in r.stdout
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)])


def test_a_folder_with_a_run_is_continued_or_overwritten(short_run, tmp_path):
    out = copy_run(short_run, tmp_path / "o")
    args = [*SHORT, "20", "--output-dir", str(out)]  # the command that made the run
    again = tiny_lm("train", *args)
    assert again.returncode == 0, again.stderr
    assert "holds a run (newest checkpoint: step 20): continuing it; --overwrite starts a new run there instead" in again.stdout
    assert "the run is complete (step 20 of 20)" in again.stdout
    fresh = tiny_lm("train", *args, "--overwrite")
    assert fresh.returncode == 0, fresh.stderr
    assert "--overwrite: this new run replaces the checkpoints" in fresh.stdout and "resumed" not in fresh.stdout
    both = in_process("train", *args, "--overwrite", "--resume-from", str(out))  # refused before any work
    assert both.returncode == 2 and "give only one of them" in both.stderr


def test_a_budget_run_stopped_and_run_again_goes_on_with_what_was_left(tmp_path, cpu_timed):
    """--time-budget 20s stopped by SIGTERM after ten seconds, then the same command: the run goes on with what its
    last save left of the budget (said in one line), not with the whole of it again."""
    from tiny_lm.checkpoint import run_meta
    out = tmp_path / "o"
    flags = [*without(RUN, "--max-steps", "--save-every"), "--save-every", "100000", "--time-budget", "20s"]
    p = start(out, *flags)  # stopped once its budget has run 7 s or more, whatever the machine's load did to its start
    wait_until(lambda: logged_steps(out) >= 12 and logged_seconds(out) > 7, p)
    p.send_signal(signal.SIGTERM)
    _, stderr = p.communicate(timeout=30)
    assert p.returncode == 143, stderr
    stopped, left = steps_on_disk(out)[-1], run_meta(out)[2]["metrics"]["budget_left"]
    assert 0 < left < 14, left  # the budget counts from the run's start, after Python's imports
    r = tiny_lm("train", *flags, "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    assert f"time budget: {left:.0f} s left of 20 s at step {stopped}" in r.stdout, r.stdout
    summary = json.loads((out / "training_summary.json").read_text())  # (its length depends on the machine's load)
    assert summary["budget_at_start"] == pytest.approx(left), summary  # (its decay may be decided already)
