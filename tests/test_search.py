"""`tiny-lm train` searching inside its time budget (nbs/08f_search), end to end: the candidates `tiny-lm plan` lists
train one after another in the budget, the best by validation loss becomes the run, and the run's commands read it."""
import json
import subprocess
import time

from test_cli import DATA, ENV


def tiny_lm(*args: str) -> subprocess.CompletedProcess:
    # compiled for speed of compiling, as the tests' runs are (conftest): the steps run slower than the plan's speed,
    # compiling faster; the search measures what its first candidate took beyond the plan and plans the rest with it
    return subprocess.run(["tiny-lm", *args], capture_output=True, text=True, env=ENV)


def test_search_trains_the_planned_candidates_in_the_budget_and_keeps_the_best(tmp_path):
    text, out = tmp_path / "plays.txt", tmp_path / "out"
    text.write_text((DATA / "tiny_shakespeare.txt").read_text()[:10_000])  # 16 passes of the nano preset: seconds
    flags = ["--dataset-id", str(text), "--vocab-size", "384", "--no-progress", "--output-dir", str(out)]
    first = tiny_lm("plan", *flags, "--time-budget", "10m", "--json")  # the planned run's time on this machine
    assert first.returncode == 0, first.stderr
    pick = json.loads(first.stdout)["search"]["candidates"][0]["seconds"]
    budget = round(3.5 * pick)  # over three times the planned run (setting up included): a search, a few candidates
    began = time.perf_counter()
    run = tiny_lm("train", *flags, "--time-budget", f"{budget}s")
    took = time.perf_counter() - began
    assert run.returncode == 0, run.stderr[-3000:]
    rows = run.stdout.split("search candidates")[1].splitlines()[1:]  # the plan's list, as `tiny-lm plan` prints it
    listed = [row.split()[0] for row in rows[:next(i for i, r in enumerate(rows) if not r.startswith("  "))]]
    assert len(listed) >= 2, run.stdout  # the pick and the size up at least
    record = json.loads((out / "search.json").read_text())
    ran = [c["name"] for c in record["candidates"]]
    assert len(ran) >= 2 and ran[0] == listed[0], (ran, listed)  # the pick first, then as many as fit
    # the budget used, the last candidate trained to its end: within a 20-second run's own landing (its compiling and
    # final scoring are a third of it: 90-105 % measured), where a minutes-long search lands as a single run does
    assert 0.8 * budget <= record["seconds"] <= 1.1 * budget, (record["seconds"], budget)
    assert took <= 1.1 * budget + 15, (took, budget)  # and the process's start (imports) before its clock
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
