"""`tiny-lm train` searching inside its time budget (nbs/08f_search), end to end: the candidates it lists train one
after another (the second on the first one's tokenizer), the best by validation loss becomes the run, the run's
commands read it, and it is scored on the half of the validation text no candidate was chosen on. `--max-candidates
2` keeps it to two candidates whatever this machine's speed; that a search fills its budget is measured in the
chapter, on minutes of a CPU."""
import json
import subprocess

from test_cli import DATA, ENV


def tiny_lm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tiny-lm", *args], capture_output=True, text=True, env=ENV)


def test_search_trains_the_listed_candidates_and_keeps_the_best(tmp_path):
    text, out = tmp_path / "plays.txt", tmp_path / "out"
    text.write_text((DATA / "tiny_shakespeare.txt").read_text()[:4_000])  # 16 passes of the nano preset: 7 steps
    run = tiny_lm("train", "--dataset-id", str(text), "--val-split", "0.2", "--vocab-size", "384", "--no-progress",
                  "--output-dir", str(out), "--time-budget", "5m", "--max-candidates", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = run.stdout.split("search candidates")[1].splitlines()[1:]  # the plan's list, as `tiny-lm plan` prints it
    listed = [row.split()[0] for row in rows[:next(i for i, r in enumerate(rows) if not r.startswith("  "))]]
    record = json.loads((out / "search.json").read_text())
    ran = [c["name"] for c in record["candidates"]]
    assert ran == listed == ["t1", "t2"], (ran, listed)  # the pick, then the next size: both fit five minutes
    assert "using tokenizer" in run.stdout.split("candidate 2")[1]  # the second reads the first one's tokenizer
    best = min(record["candidates"], key=lambda c: c["val_loss"])
    summary = json.loads((out / "training_summary.json").read_text())
    assert record["winner"] == best["name"] and summary["best_loss"] == best["val_loss"]
    assert summary["output_dir"] == str(out) and summary["search"]["winner"] == best["name"]
    assert (out / "final_checkpoint").is_dir() and (out / "search.png").exists()
    assert not (out / "search" / best["name"]).exists()  # moved up: the run's commands read the winner
    loser = out / "search" / (set(ran) - {best["name"]}).pop()
    assert (loser / "training_summary.json").exists() and not list(loser.glob("checkpoint_step_*"))
    sample = tiny_lm("generate", "--checkpoint", str(out), "--max-tokens", "8")
    assert sample.returncode == 0 and sample.stdout.strip(), sample.stderr
    assert "lowest validation loss (*) on half of the validation documents is the result" in run.stdout
    figures = record["figures"]  # the winner on the half of each validation document it was chosen on, and the other
    assert figures["unchosen"]["tokens"] > 0 and figures["chosen_on"]["tokens"] > 0, figures
    assert summary["unchosen_val_bpb"] == figures["unchosen"]["bits_per_byte"]
    assert "the odd-numbered documents of it" in figures["unchosen"]["text"]
    assert "that no candidate was chosen on" in run.stdout
