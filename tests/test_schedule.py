"""The learning rate across resumes and continuations, as `tiny-lm train` logs it in metrics.jsonl (issue 27, cases 3
and 7): one 30-step run, resumed at the same length and continued to twice its length."""
import json
import math
import re
import shutil

import numpy as np
import pytest

from test_cli import AS_USERS, DATA, ENV, SMALL, tiny_lm, without
from test_faults import steps_on_disk

PEAK, WARMUP = 3e-3, 3  # --warmup-steps 50 on a 30-step run: at most a tenth of it
FLAGS = [*without(SMALL, "--eval-every", "--save-every"), "--learning-rate", str(PEAK), "--warmup-steps", "50",
         "--log-every", "1", "--eval-every", "30", "--save-every", "10"]


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def rates(out) -> dict:
    """step -> learning rate of that step's update, and checks that no step is logged twice."""
    train = [r for r in records(out) if "loss" in r]
    steps = [r["step"] for r in train]
    assert len(steps) == len(set(steps)), f"steps logged more than once: {sorted(s for s in steps if steps.count(s) > 1)}"
    val_steps = [r["step"] for r in records(out) if "val_loss" in r]
    assert len(val_steps) == len(set(val_steps)), val_steps
    return {r["step"]: r["lr"] for r in train}


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """A run of 30 steps, every step logged."""
    out = tmp_path_factory.mktemp("schedule") / "run"
    r = tiny_lm("train", *FLAGS, "--max-steps", "30", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    return out


def test_short_run_warms_up_briefly_and_ends_below_the_peak(short_run):
    lr = rates(short_run)
    assert sorted(lr) == list(range(1, 31))
    assert lr[1] > 0  # the first update moves the model
    assert max(lr.values()) == pytest.approx(PEAK, rel=1e-5) and max(lr, key=lr.get) == WARMUP
    assert lr[30] == pytest.approx(PEAK / 10, rel=1e-5)  # the cosine's end: --min-lr-ratio 0.1


def test_resume_at_the_same_length_is_exact_and_logs_each_step_once(short_run, tmp_path):
    """Steps 21-30 logged, then a crash before step 30's save: the resume from step 20 runs them again at the same
    rates, and metrics.jsonl holds each step once."""
    split = tmp_path / "split"
    shutil.copytree(short_run, split)
    for name in ("checkpoint_step_30", "final_checkpoint", "best_checkpoint"):
        shutil.rmtree(split / name, ignore_errors=True)
    r = tiny_lm("train", "--resume-from", str(split), "--output-dir", str(split), "--max-steps", "30", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "at step 20 of 30" in r.stdout
    whole, resumed = rates(short_run), rates(split)
    assert sorted(resumed) == list(range(1, 31))
    assert [resumed[s] for s in range(21, 31)] == pytest.approx([whole[s] for s in range(21, 31)], rel=1e-6)


def test_training_further_never_jumps_the_rate(short_run, tmp_path):
    """The finished 30-step run continued to 60: from the rate in force at step 30 the rate rises at most by the warm-up's
    slope per step back to the peak, then decays to the end rate at step 60."""
    further = tmp_path / "further"
    shutil.copytree(short_run, further)
    r = tiny_lm("train", "--resume-from", str(further), "--output-dir", str(further), "--max-steps", "60", "--no-progress")
    assert r.returncode == 0, r.stderr
    lr = rates(further)
    assert sorted(lr) == list(range(1, 61))
    steps = [lr[s + 1] - lr[s] for s in range(1, 60)]
    assert max(abs(d) for d in steps) <= PEAK / WARMUP * (1 + 1e-4), max(steps, key=abs)
    assert lr[31] == pytest.approx(lr[30], rel=1e-4)  # the continuation starts where the run ended
    assert max(lr[s] for s in range(31, 61)) == pytest.approx(PEAK, rel=1e-5)
    assert lr[60] == pytest.approx(PEAK / 10, rel=1e-5)


def landing(folder, budget: int, xla_flags: str | None = None) -> tuple:
    """The case of the test below at `budget` seconds, in `folder`, with a compile cache of its own (and `xla_flags`
    where given): the command's result, its output folder, its summary and the budget."""
    env = {**ENV, "JAX_COMPILATION_CACHE_DIR": str(folder / "jax_cache"), "XLA_FLAGS": xla_flags or ENV["XLA_FLAGS"]}
    command = [*without(FLAGS, "--num-layers", "--log-every", "--eval-every", "--save-every", "--warmup-steps"),
               "--num-layers", "8", "--log-every", "2", "--eval-every", "10", "--save-every", "100000",
               "--warmup-steps", "2", "--decay-fraction", "0.03",
               "--val-split", "0.2", "--eval-batches", "20", "--time-budget", f"{budget}s"]
    r = tiny_lm("train", *command, "--output-dir", str(folder / "budget"), env=env)
    assert r.returncode == 0, r.stderr
    return r, folder / "budget", json.loads((folder / "budget" / "training_summary.json").read_text()), budget


def test_time_budget_lands_within_five_percent_where_compiling_and_evaluating_are_a_third(tmp_path, cpu_timed):
    """`--time-budget` on a model whose compiling and evaluating take a third of the budget or more (8 layers, an
    evaluation every 10 steps; measured from the summary) ends within 5 % of it: `budget_used` in [0.95, 1], the last
    evaluation, save and the scoring of the validation text included; its evaluations kept to a tenth of it (said).

    The tolerance follows from the mechanism, not from a quiet machine: everything before the clock decides is
    measured (the compiles, evaluations, saves and drawings too), so the landing misses the plan only by how much
    the machine's speed changes over what the plan had left to foresee (F): the decay (3 % of the steps), its
    evaluations, the one save at the end and its write, the last drawing of loss.png and the scoring. The plan ends
    early enough (04b_budget's `landing_steps`) that F may take r times as long or 1/r as long and still land in
    [0.95, 1], r = (h + hypot(F, h)) / F for the band's half-width h (0.5 s): F is asserted to be at most 7.5 % of
    the budget (0.70-0.78 s here, 1.08 once in CI), so r is at least 1.39 (a CI run of a 30 s budget, its plan aimed
    at the band's middle, foresaw 0.95 s, which another test slowed 1.85 times: it ended at 1.004). The budget is
    20 s: since loss.png is drawn at most every 30 s, not at each evaluation, the evaluations of a 30 s run took 3 s,
    not 8, and compiling and evaluating no longer filled a third of it (7-9 s). The default decay, 30 % of the
    steps, leaves several times as much to foresee (it landed at 0.959 and 0.967 in two runs of 30 s here).

    Where the machine is so slow that compiling and the set-up before it leave the clock nothing to plan before the
    first evaluation (CI, three tests on two cores, compiling two to three times as slowly: the first evaluation's
    compile still to come when it decided, F 6 s of 20), or so fast that compiling and evaluating take less than a
    third of 20 s (an AMD EPYC: 5.9 s, most of it the three compiles, which do not shrink with the budget), the run is
    not this case; nor where a loaded machine leaves the plan more than 7.5 % to foresee (a CI run beside two others:
    its save timed slow, F 1.63 s of 20, landed at 0.945). It runs again (three runs at most), and the last run is the
    one asserted: where F was too big, with a budget it is 7 % of (at most three times compiling and evaluating, so
    that they still take a third); where it was too slow, with a budget 2.2 times what compiling and evaluating took
    (45 % of it); where too fast, its programs compiled
    with XLA's default optimisations, as users' are (the EPYC: 9.1 and 9.6 s of compiling and evaluating in 20 s,
    landed at 0.982 and 0.978; a third run where that made the clock decide before its first evaluation, as in a
    loaded CI run: 13.8 s of 20, F 4.45 s). A shorter budget is no way to this case on a fast machine: the evaluations
    shrink with it (at most a tenth), the compiles and what the plan foresees do not (at 8 s: F 0.60 and 0.68 s, over
    the 7.5 %; landed at 0.951 and 0.944)."""
    # a compile cache of its own: the step, the evaluation and the scoring compile here (a cache other tests share may
    # hold them); 20 validation batches (the held-out fifth holds 21), more than a tenth of the budget holds at every
    # 10 steps: the run chooses fewer (5 here), and says so (10 were few enough for a slow CI machine, whose compiling
    # left fewer evaluations to come); a 2-step warm-up, over before the clock can decide; one save, the
    # last (in a 30 s budget a save every 10 steps put 1-2 more inside the decay: 1.52 s to foresee once, over the 5 %
    # this asserts); a decay of 3 % (5 % foresaw 1.51 s of 30 once, the first save's write counted: 22 steps and 3
    # evaluations); 20 s: compiling and evaluating took 8.5 and 9.3 s of it in two runs here, F 0.70 and 0.78 s
    budget, xla_flags = 20, None
    for attempt in range(3):  # until the run is this case
        r, out, summary, budget = landing(tmp_path / f"run{attempt}", budget, xla_flags)
        outside = summary["compile_seconds"] + summary["eval_seconds"] + summary["scoring_compile_seconds"]
        if summary["decay_plan"]["costs"]["eval_compile"] > 0:  # decided before the first evaluation: too slow
            budget = math.ceil(2.2 * outside)
        elif outside < budget / 3:  # compiling and evaluating under a third: too fast (an AMD EPYC: 5.9 s of 20)
            xla_flags = AS_USERS["XLA_FLAGS"]  # compiled as users' programs are (2 devices too): more to compile
        elif (foreseen := summary["decay_plan"]["seconds"]) > 0.075 * budget and attempt < 2:  # loaded: F too big
            budget = min(math.ceil(foreseen / 0.07), math.floor(3 * outside))  # F 7 % of it, still a third outside
        else:
            break
    lr, last, decay = rates(out), summary["total_steps"], summary["decay_start"]
    assert 0 < decay < last == max(lr) and lr[last] == pytest.approx(PEAK / 10, rel=1e-5)
    print(f"budget used: {summary['budget_used']:.3f} of {budget} s; compiling and evaluating {outside:.1f} s; "
          f"the plan foresaw {summary['decay_plan']['seconds']:.2f} s, {last - decay} steps of decay")
    assert outside >= budget / 3, summary  # the case this test is for
    assert summary["decay_plan"]["seconds"] <= 0.075 * budget, summary["decay_plan"]  # what the plan had to foresee
    assert summary["decay_plan"]["costs"]["save"] > 0, summary["decay_plan"]  # a save was timed before it decided
    assert 0.95 <= summary["budget_used"] <= 1.0, {k: summary[k] for k in ("budget_used", "decay_plan", "total_time")}
    assert "validation:" in r.stdout and 0 < summary["eval_tokens"] < 20 * 8 * 32, r.stdout
    assert summary["final_val_bpb_tokens"] > 0


def test_time_budget_decides_the_length_and_decays_to_the_end(tmp_path, cpu_timed):
    """`--time-budget` alone: the run holds the peak, its clock starts the decay, and it ends at the end rate with an
    evaluation and a save; the summary records the budget and the step the decay started at. Stopped inside its
    decay and run again, it ends on the same weights, bit for bit."""
    # a save every step and half the budget for the decay: a checkpoint inside the decay once it is two steps long,
    # even where the machine is loaded and the compile takes much of these 15 s (CI once decayed over steps 10-15
    # only); a 2-step warm-up, over before the clock can decide (its first log step with a step time: 4)
    out = tmp_path / "budget"
    command = [*without(FLAGS, "--log-every", "--save-every", "--warmup-steps"), "--log-every", "2", "--save-every",
               "1", "--warmup-steps", "2", "--decay-fraction", "0.5", "--time-budget", "20s"]
    r = tiny_lm("train", *command, "--output-dir", str(out), process=True)  # a whole process in its budget
    assert r.returncode == 0, r.stderr
    assert "| steps set by its time budget" in r.stdout and str(10**9) not in r.stdout  # the model line says so
    summary = json.loads((out / "training_summary.json").read_text())
    lr, last = rates(out), summary["total_steps"]
    assert summary["time_budget"] == 20 and 0 < summary["decay_start"] < last == max(lr)
    assert lr[last] == pytest.approx(PEAK / 10, rel=1e-5)  # the last update at the end rate
    decay = summary["decay_start"]
    assert lr[decay] == max(lr.values()) and all(lr[s] < lr[decay] for s in lr if s > decay)  # then only down
    assert (out / f"checkpoint_step_{last}").is_dir() and summary["final_val_loss"] is not None
    print(f"budget used: {summary['budget_used']:.3f}")  # how close it landed, on a machine shared with other tests

    # a copy of the run stopped inside its decay: the same command resumes it with the same compiled step (the decay
    # is the step's data), to the length its clock decided, on the weights of the run that was not stopped. A stop
    # after the clock last drew the decay again (`replanned`: a loaded machine's speed changed; a checkpoint at that
    # step holds the decay before it): where it drew it again at the decay's last steps, no checkpoint lies after
    # it (CI once: 56 of 60, then 57), and the copy resumes from the first step of the decay to the end that step
    # recorded instead, which the weights then cannot match
    redrawn = [again["step"] for again in summary["decay_plan"].get("replanned", [])]
    inside = [s for s in steps_on_disk(out) if max([decay, *redrawn]) < s < last]
    first = inside[0] if inside else min(s for s in steps_on_disk(out) if decay < s)
    stopped = tmp_path / "stopped"
    shutil.copytree(out, stopped)
    later = [f"checkpoint_step_{s}" for s in steps_on_disk(out) if s > first]
    for name in [*later, "final_checkpoint", "best_checkpoint"]:
        shutil.rmtree(stopped / name, ignore_errors=True)
    r = tiny_lm("train", *command, "--output-dir", str(stopped), process=True)
    assert r.returncode == 0, r.stderr
    recorded = re.search(rf"at step {first} of (\d+)", r.stdout)  # the end that step's checkpoint recorded
    assert recorded, r.stdout
    if not inside:
        print(f"redrawn at steps {redrawn}: resumed from step {first} to {recorded[1]}, not compared with {last}")
        return
    assert int(recorded[1]) == last, r.stdout
    for whole, resumed in zip(params(out / f"checkpoint_step_{last}"), params(stopped / f"checkpoint_step_{last}")):
        np.testing.assert_array_equal(whole, resumed)


def params(checkpoint) -> list:
    from flax import nnx
    import jax
    from tiny_lm.checkpoint import load_checkpoint
    model, _, _ = load_checkpoint(checkpoint)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def test_a_sized_run_on_little_text_ends_after_sixteen_passes_not_at_its_budget(tmp_path):
    """`--time-budget` alone, the model sized by the plan, on text that the time would pass over far more than 16
    times: the run ends after 16 passes (the plan's `--epochs`, 05c_profiles' MAX_EPOCHS), long before its budget,
    decays to the end rate on its own steps (its clock never decides), and says so in the banner and at the end.
    The same command again finds it complete; a longer `--max-steps` trains it further (08e_settings)."""
    text = tmp_path / "plays.txt"  # 4 KB of the fixture: 16 passes in 7 steps (15 KB took 34 s at the 5,000 tokens/s
    text.write_text((DATA / "tiny_shakespeare.txt").read_text()[:4_000])  # of the tests' unoptimised XLA)
    out = tmp_path / "run"
    r = tiny_lm("train", "--dataset-id", str(text), "--val-split", "0.2", "--vocab-size", "384", "--time-budget", "10m",
                "--no-progress", "--sample-tokens", "0", "--log-every", "1", "--output-dir", str(out),
                "--no-search")  # the planned run alone (08f_search would train candidates in the rest of the time)
    assert r.returncode == 0, r.stderr
    assert "plan: passes: the run ends after 16 passes over the data" in r.stdout, r.stdout
    assert "or its time budget, whichever ends first" in r.stdout, r.stdout  # the model line: both ends
    assert "time budget: the run ended by its 16 passes over the data (the plan) first" in r.stdout, r.stdout
    summary = json.loads((out / "training_summary.json").read_text())
    print({k: summary[k] for k in ("epochs", "total_steps", "budget_used", "total_time", "compile_seconds",
                                   "eval_seconds", "scoring_compile_seconds")})
    steps = summary["total_steps"]  # whole steps: the first that completes 16 passes
    assert 16 <= summary["epochs"] < 16 * steps / (steps - 1) and summary["budget_used"] < 0.5, summary
    assert summary["decay_start"] is None and summary["decay_plan"] is None, summary  # the clock never decided
    lr, last = rates(out), summary["total_steps"]
    assert last == max(lr) and lr[last] < max(lr.values()) / 5, lr  # decayed by its steps, to the end rate's side
    again = tiny_lm("train", "--output-dir", str(out), "--time-budget", "10m", "--no-progress", "--sample-tokens", "0")
    assert again.returncode == 0 and "the run is complete" in again.stdout, again.stdout  # the same length: done
    further = tiny_lm("train", "--output-dir", str(out), "--max-steps", str(last + 3), "--no-progress",
                      "--sample-tokens", "0")  # a longer length given replaces its passes and budget
    assert further.returncode == 0 and f"at step {last} of {last + 3}" in further.stdout, further.stdout
    assert json.loads((out / "training_summary.json").read_text())["total_steps"] == last + 3
