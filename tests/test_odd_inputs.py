"""Our own odd-input suite: every command against every kind of odd input a user can name.

Each case must end in one line that starts with `error:`, exit status 2, no traceback, no hang, and nothing changed
on disk: neither in the folder of odd inputs, nor in the trained run the commands read. Most cases are refused before
any slow work, so they run in this process (`test_cli.in_process`); a few run the whole `tiny-lm` process as a user
does. Grow the table whenever a user-facing defect is found: the point is the class of input, not the case.

The kinds of input (issue 42): an output folder (a file, under a file, a virtual or read-only file system, too
long, empty, a folder of other files), an input path (missing, a file where a folder is needed and the reverse,
empty, binary, a text column holding numbers), a tokenizer file with the flags it makes moot, and a checkpoint
folder (not a run, a run of another version, a LoRA run without its base). Reading a file without permission cannot
happen to root, who runs CI: `path_to_read` checks it with `os.access` (00_errors).
"""
import json
import os
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from test_cli import DATA, ENV, SMALL, in_process, snapshot, tiny_lm, unchanged, without, xla_flags

LONG = "x" * 300  # a name longer than any file system's 255 bytes
TOKENIZER = ["--tokenizer-path", "{RUN}/tokenizer.json"]
BASE = without(SMALL, "--vocab-size")  # a small run's flags, the vocabulary left to the case

PATHS = {  # kind of input -> (the flags, what the one line must say); {W}: the odd inputs, {RUN}: a trained run
    "output is a file": (["--output-dir", "{W}/file.txt"], "is a file, not a folder"),
    "output under a file": (["--output-dir", "{W}/file.txt/run"], "is a file, so no folder can be made under it"),
    "output in /proc": (["--output-dir", "/proc/tiny-lm-run"], "cannot write in /proc"),
    "output in /sys": (["--output-dir", "/sys/tiny-lm-run"], "cannot write in /sys"),
    "output too long": (["--output-dir", "{W}/" + LONG], "is too long"),
    "output /dev/null": (["--output-dir", "/dev/null"], "is a file, not a folder"),
    "output empty": (["--output-dir", ""], "--output-dir is empty"),
    "output holds other files": (["--output-dir", "{W}/others"], "holds files that are not a run (a.bin, b.txt)"),
    "backup is a file": (["--backup-dir", "{W}/file.txt"], "--backup-dir {W}/file.txt is a file"),
    "compile cache is a file": (["--compile-cache", "{W}/file.txt"], "--compile-cache {W}/file.txt is a file"),
    "compile cache in /proc": (["--compile-cache", "/proc/cache"], "cannot write in /proc"),
    "data missing": (["--dataset-id", "{W}/missing.txt"], "does not exist"),
    "data empty": (["--dataset-id", "{W}/empty.txt"], "is empty"),
    "data binary": (["--dataset-id", "{W}/binary.txt"], "is not UTF-8 text"),
    "data column of numbers": (["--dataset-id", "{W}/numbers.jsonl"], "holds int, not text"),
    "data not JSON": (["--dataset-id", "{W}/broken.jsonl"], "is not JSON"),
    "data empty folder": (["--dataset-id", "{W}/empty_folder"], "has no .txt, .jsonl"),
    "data /dev/null": (["--dataset-id", "/dev/null"], "is not a .txt, .jsonl"),
    "tokenizer missing": (["--tokenizer-path", "{W}/missing.json"], "does not exist"),
    "tokenizer is a folder": (["--tokenizer-path", "{W}/empty_folder"], "is a folder, not a file"),
    "tokenizer empty": (["--tokenizer-path", "{W}/empty.txt"], "is empty"),
    "tokenizer not one": (["--tokenizer-path", "{W}/numbers.jsonl"], "is not a Hugging Face tokenizer.json"),
    "tokenizer and --vocab-size": ([*TOKENIZER, "--vocab-size", "999"], "so --vocab-size would do nothing"),
    "tokenizer and --auto-vocab-size": ([*TOKENIZER, "--auto-vocab-size"], "so --auto-vocab-size would do nothing"),
    "tokenizer and --retrain-tokenizer": ([*TOKENIZER, "--retrain-tokenizer"], "--retrain-tokenizer would do nothing"),
    "tokenizer and --min-vocab-size": ([*TOKENIZER, "--min-vocab-size", "600"], "--min-vocab-size would do nothing"),
    "resume from missing": (["--resume-from", "{W}/missing"], "does not exist"),
    "resume from a file": (["--resume-from", "{W}/file.txt"], "is a file, not a folder"),
    "resume from not a run": (["--resume-from", "{W}/empty_folder"], "holds no checkpoint"),
    "resume from another version": (["--resume-from", "{W}/newer_run"], "in checkpoint format 99"),
    "init from missing": (["--init-from", "{W}/missing"], "does not exist"),
    "init from a file": (["--init-from", "{W}/file.txt"], "is a file, not a folder"),
    "init from not a run": (["--init-from", "{W}/empty_folder"], "is not a training run"),
    "init from another version": (["--init-from", "{W}/newer_run"], "in checkpoint format 99"),
}
CHECKPOINTS = {  # what --checkpoint (or inspect's path) names -> what the one line must say
    "missing": ("{W}/missing", "does not exist"),
    "a file": ("{W}/file.txt", "is a file, not a folder"),
    "not a run": ("{W}/empty_folder", "no checkpoint in"),
    "a folder of other files": ("{W}/others", "no checkpoint in"),
    "a run of another version": ("{W}/newer_run", "in checkpoint format 99"),
    "a LoRA run without its base": ("{W}/lora_run", "holds LoRA adapters for base run"),
}
NOT_IN_BENCH_DATA = ("auto-vocab", "retrain", "min-vocab")  # flags `tiny-lm bench data` does not take


def cases() -> list:
    """(command's argv, what its line must say) for every command and every kind of odd input it takes."""
    table = []
    for kind, (flags, said) in PATHS.items():
        table.append((f"train: {kind}", ["train", *BASE, "--max-steps", "2", "--output-dir", "{W}/new", *flags], said))
        if not kind.startswith("resume"):  # plan plans new runs: it refuses --resume-from whatever it names
            table.append((f"plan: {kind}", ["plan", *BASE, "--output-dir", "{W}/new", *flags], said))
            # compile plans as plan does, its paths checked before its compilers are looked for (none here)
            table.append((f"compile: {kind}", ["compile", "--profile", "h100", *BASE, "--output-dir", "{W}/new",
                                               *flags], said))
        if kind.startswith(("data", "tokenizer")) and not any(k in kind for k in NOT_IN_BENCH_DATA):
            table.append((f"bench data: {kind}", ["bench", "data", "--tokens", "1000", *flags], said))
        if kind.startswith("data"):
            table.append((f"eval: {kind}", ["eval", "--checkpoint", "{RUN}", *flags], said))
    for kind, (path, said) in CHECKPOINTS.items():
        table += [(f"generate: {kind}", ["generate", "--checkpoint", path, "--max-tokens", "2"], said),
                  (f"eval: checkpoint {kind}", ["eval", "--checkpoint", path], said),
                  (f"export: {kind}", ["export", "--checkpoint", path, "--out", "{W}/hf"], said),
                  (f"inspect: {kind}", ["inspect", path], said),
                  (f"bench generate: {kind}", ["bench", "generate", "--checkpoint", path, "--max-tokens", "2"], said)]
    for kind, out, said in [("out is a file", "{W}/file.txt", "is a file, not a folder"),
                            ("out in /proc", "/proc/hf", "cannot write in /proc"),
                            ("out under a file", "{W}/file.txt/hf", "so no folder can be made under it"),
                            ("out too long", "{W}/" + LONG, "is too long"),
                            ("out holds other files", "{W}/others", "exists: pass --overwrite")]:
        table.append((f"export: {kind}", ["export", "--checkpoint", "{RUN}", "--out", out], said))
    for kind, trace, said in [("trace is a file", "{W}/file.txt", "--trace {W}/file.txt is a file"),
                              ("trace in /proc", "/proc/trace", "cannot write in /proc")]:
        table.append((f"bench train: {kind}", ["bench", "train", "--model-preset", "nano", "--steps", "1",
                                               "--trace", trace], said))
    table.append(("size: no layers", ["size", "--num-layers", "0"], "--num-layers must be at least 1"))
    return table


CASES = {name: (argv, said) for name, argv, said in cases()}
# `bench generate` sets up the CPU's devices before it reads a checkpoint (Orbax starts JAX), which a process that
# has started JAX (this one) cannot: where the folder is a run, the case runs as users run it, in a process of its own
IN_A_SUBPROCESS = {"bench generate: a run of another version", "bench generate: a LoRA run without its base"}


def odd_inputs(folder: Path, run: Path) -> Path:
    """The folder of odd inputs: files and folders of every kind the table names, and two doctored copies of `run`."""
    folder.mkdir()
    (folder / "file.txt").write_text("a file, where a folder is needed\n")
    (folder / "empty.txt").write_text("")
    (folder / "binary.txt").write_bytes(bytes(range(256)) * 16)
    (folder / "numbers.jsonl").write_text("".join(json.dumps({"text": i}) + "\n" for i in range(20)))
    (folder / "broken.jsonl").write_text("{not json\n" * 5)
    (folder / "empty_folder").mkdir()
    (folder / "others").mkdir()
    (folder / "others" / "a.bin").write_bytes(b"\0" * 8)
    (folder / "others" / "b.txt").write_text("the user's own notes")
    newer = _doctored(run, folder / "newer_run", lambda meta: meta | {"format": 99, "tiny_lm": "9.0"})
    assert newer.is_dir()
    base = {"path": str(folder / "deleted_base"), "step": 80, "fingerprint": "0" * 16}
    _doctored(run, folder / "lora_run", lambda meta: {**meta, "config": {
        **meta["config"], "model": {**meta["config"]["model"], "lora_rank": 4}, "init_from": base}})
    return folder


def _doctored(run: Path, copy: Path, change) -> Path:
    """A copy of `run` whose every step's meta record is `change(record)`: a run another tiny_lm might have written."""
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("cache", "best_checkpoint", "final_checkpoint"))
    for record in copy.glob("checkpoint_step_*/meta/metadata"):
        record.write_text(json.dumps(change(json.loads(record.read_text()))))
    return copy


@pytest.fixture(scope="module")
def odd(trained, tmp_path_factory):
    """The folder of odd inputs and the trained run, with their contents before any case ran."""
    run, _ = trained
    folder = odd_inputs(tmp_path_factory.mktemp("odd") / "inputs", run)
    return folder, run, snapshot(folder), snapshot(run)


class Hang(Exception):
    pass


def _hang(signum, frame):
    raise Hang()


def check_refused(r, said: str) -> None:
    """One line that starts with `error:` and says `said`; status 2; no traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: "), r.stderr
    assert said in r.stderr, (said, r.stderr)


@pytest.mark.parametrize("case", list(CASES))
def test_an_odd_input_is_one_line_and_touches_nothing(odd, case):
    folder, run, before, run_before = odd
    argv, said = CASES[case]
    fill = lambda s: s.replace("{W}", str(folder)).replace("{RUN}", str(run))
    signal.signal(signal.SIGALRM, _hang)
    signal.alarm(60)  # refused before any slow work: a minute is a hang
    try:
        argv = [fill(a) for a in argv]
        r = tiny_lm(*argv, timeout=120, process=True) if case in IN_A_SUBPROCESS else in_process(*argv)
    finally:
        signal.alarm(0)
    check_refused(r, fill(said))
    assert snapshot(folder) == before, "a file in the odd inputs was changed"
    assert unchanged(run, run_before), "the trained run was changed"
    assert not any(Path(p).exists() for p in ("/proc/tiny-lm-run", "/sys/tiny-lm-run", str(folder / "new")))


def test_every_command_meets_the_suite():
    """The table covers every command (and every bench), and every kind of checkpoint on every reading command."""
    from tiny_lm.cli import COMMANDS
    commands = {name.split(":")[0] for name in CASES}
    assert commands >= {*COMMANDS, "bench data", "bench train", "bench generate"} - {"bench"}, commands
    for reader in ("generate", "eval", "export", "inspect", "bench generate"):
        assert all(any(n.startswith(reader) and n.endswith(kind) for n in CASES) for kind in CHECKPOINTS), reader


@pytest.mark.parametrize("case", ["train: output is a file", "generate: a run of another version",
                                  "export: out in /proc"])
def test_the_whole_command_says_the_same_line(odd, case):
    """A few cases as users run them, in a process of their own: the console script's exit status and its one line."""
    folder, run, before, _ = odd
    argv, said = CASES[case]
    fill = lambda s: s.replace("{W}", str(folder)).replace("{RUN}", str(run))
    r = tiny_lm(*map(fill, argv), timeout=120, process=True)
    check_refused(r, fill(said))
    assert snapshot(folder) == before
    assert os.path.isdir(run)


def test_a_batch_too_big_for_the_memory_is_one_line(tmp_path):
    """A batch far too big for the device's memory: `tiny-lm train` warns before its first step (the estimate), XLA
    fails to allocate (`RESOURCE_EXHAUSTED`), and the command ends in one line that says so and what to try (00_errors'
    `out_of_memory`), status 2, no traceback, no checkpoint. The process's address space is capped at 8 GiB, so that
    the allocation fails however much a machine lets a process overcommit; one CPU device, since a split CPU's other
    device would wait for the failed one at the gradients' all-reduce (XLA ends such a process after its wait)."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    out = tmp_path / "run"
    argv = ["tiny-lm", "train", "--dataset-id", str(DATA / "tiny_shakespeare.txt"), "--vocab-size", "300",
            "--val-split", "0.2", "--seq-len", "1024", "--batch-size", "512", "--d-model", "256", "--num-layers", "4",
            "--num-heads", "4", "--max-steps", "2", "--no-progress", "--sample-tokens", "0", "--cpu-devices", "1",
            "--output-dir", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, env={**ENV, "XLA_FLAGS": xla_flags()}, timeout=300,
                       preexec_fn=cap)
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    assert "warning: training needs about" in r.stdout, r.stdout  # said before the first step
    last = r.stderr.strip().splitlines()[-1]  # (XLA's own log lines may come before it)
    assert last.startswith("error: the device ran out of memory (Out of memory allocating"), r.stderr[-3000:]
    assert "--batch-size" in last and not list(out.glob("checkpoint_step_*")), last

