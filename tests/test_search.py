"""`tiny-lm train` searching inside its time budget (nbs/08f_search), end to end: the candidates `tiny-lm plan` lists
train one after another in the budget, the best by validation loss becomes the run, and the run's commands read it."""
import json
import subprocess
import time

from test_cli import AS_USERS, DATA

BUDGET = 40  # seconds: the planned run (the nano preset, 16 passes over 60 KB) takes about a quarter of it
FLAGS = ["--dataset-id", str(DATA / "tiny_shakespeare.txt"), "--vocab-size", "384", "--time-budget", f"{BUDGET}s",
         "--no-progress"]


def tiny_lm(*args: str) -> subprocess.CompletedProcess:
    # compiled as users' programs are: the plan times the CPU so, and the candidates' steps must run at that speed
    return subprocess.run(["tiny-lm", *args], capture_output=True, text=True, env=AS_USERS)


def test_search_trains_the_planned_candidates_in_the_budget_and_keeps_the_best(tmp_path):
    out = tmp_path / "out"
    plan = tiny_lm("plan", *FLAGS, "--output-dir", str(out), "--json")
    assert plan.returncode == 0, plan.stderr
    listed = [c["name"] for c in json.loads(plan.stdout)["search"]["candidates"]]
    assert len(listed) >= 3, plan.stdout  # the sizes around the pick at least
    began = time.perf_counter()
    run = tiny_lm("train", *FLAGS, "--output-dir", str(out))
    took = time.perf_counter() - began
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((out / "search.json").read_text())
    ran = [c["name"] for c in record["candidates"]]
    assert len(ran) >= 2 and ran[0] == listed[0], (ran, listed)  # the pick first, then as many as fit
    assert record["seconds"] <= 1.05 * BUDGET and took <= 1.05 * BUDGET + 15, (record["seconds"], took)  # + imports
    best = min(record["candidates"], key=lambda c: c["val_loss"])
    summary = json.loads((out / "training_summary.json").read_text())
    assert record["winner"] == best["name"] and summary["best_loss"] == best["val_loss"]
    assert summary["output_dir"] == str(out) and summary["search"]["winner"] == best["name"]
    assert (out / "final_checkpoint").is_dir() and (out / "search.png").exists()
    assert not (out / "search" / best["name"]).exists()  # moved up: the run's commands read the winner
    for name in set(ran) - {best["name"]}:
        assert (out / "search" / name / "training_summary.json").exists()
        assert not list((out / "search" / name).glob("checkpoint_step_*"))
    sample = tiny_lm("generate", "--checkpoint", str(out), "--max-tokens", "8")
    assert sample.returncode == 0 and sample.stdout.strip(), sample.stderr
    assert "lowest validation loss (*) is the result" in run.stdout
