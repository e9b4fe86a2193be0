"""The `tiny-lm` command end to end on the fixtures in tests/data/: in this process, or in subprocesses where the
process itself is checked (see `tiny_lm`)."""
import contextlib
import hashlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "data"
# JAX's persistent compilation cache, shared by every tiny-lm the tests start: a program compiled once (same model, same
# devices) is loaded, not compiled again, which halves a small run's time. The executables are the same, so are the results.
JAX_CACHE = {"JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR")  # check.sh's, for the whole run
             or str(Path(tempfile.gettempdir()) / "tiny_lm_tests_jax_cache"),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
# The XLA flags the whole test run was given (tests/check.sh: compiled for speed of compiling), with each
# test's count of CPU devices added. Without a count of their own: pytest-xdist's workers inherit the environment
# that this module gives its process (below), devices counted.
XLA_BASE = re.sub(r"\s*--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()


def xla_flags(devices: int | None = None) -> str:
    return f"{XLA_BASE} --xla_force_host_platform_device_count={devices}".strip() if devices else XLA_BASE


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", "XLA_FLAGS": xla_flags(2), **JAX_CACHE}
# what users' programs compile with (XLA's default optimisations: the run's flags less check.sh's two for fast
# compiling, its collective wait kept): what the checks of speed and of profiles measure
USERS_XLA_BASE = re.sub(r"\s*--(xla_backend_optimization_level=0|xla_cpu_use_fusion_emitters=false)", "",
                        XLA_BASE).strip()
AS_USERS = {**ENV, "XLA_FLAGS": f"{USERS_XLA_BASE} --xla_force_host_platform_device_count=2".strip()}
SMALL = ["--dataset-id", str(DATA / "tiny_shakespeare.txt"), "--vocab-size", "384", "--seq-len", "32",
         "--d-model", "32", "--num-layers", "1", "--num-heads", "2", "--batch-size", "4",  # per device: 8 on the 2 devices
         "--eval-every", "40", "--save-every", "40", "--no-progress",
         "--sample-tokens", "0"]  # no sample at the end: only the `trained` run's is checked


def without(flags: list, *names: str) -> list:
    """`flags` with the options `names` and their values left out."""
    out, skip = [], False
    for a in flags:
        if skip or a in names:
            skip = not skip and a in names
            continue
        out.append(a)
    return out


NO_DIMS = without(SMALL, "--d-model", "--num-layers", "--num-heads")
# 2 layers, 4 query heads sharing 2 key/value heads (test_export compares it with transformers: its 4-step run loads
# the programs this file's compiles)
GQA = [*without(SMALL, "--num-layers", "--num-heads"), "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2"]


# This test process runs `tiny-lm` itself (`tiny_lm`, `in_process` below), in the environment the subprocesses get:
# the same XLA flags (two CPU devices), compilation cache and quiet progress bars. Set before JAX is first imported.
os.environ.update(ENV)


def tiny_lm(*args, env=ENV, timeout=300, process=False) -> subprocess.CompletedProcess:
    """`tiny-lm ARGS`: its exit status and what it printed. Run in this process by `main`, the console script's own
    function, unless the process itself is what the test checks (`process=True`: a second start, signals, a pipe's
    end, the console script) or it needs another environment (`env`: other devices or XLA flags); then the installed
    console script runs in a subprocess. A small run's start-up is most of its cost: 5.7 s for a 4-step run in a
    subprocess, 2.4 s of it importing, and each eager operation's program loaded again (34 in a 4-step run)."""
    if process or env is not ENV:
        return subprocess.run(["tiny-lm", *args], capture_output=True, text=True, env=env, timeout=timeout)
    return in_process(*args)


def snapshot(folder: Path) -> list:
    """(path, size, modified) of everything under `folder` but the empty folders `.tiny-lm-check-*` that another
    worker's command makes and removes in a moment (see `unchanged`): CI once listed one and found it gone a moment
    later, when it asked for its size (2026-11-30)."""
    seen = []
    for root, dirs, files in os.walk(folder):  # (os.walk passes over a folder removed while it walks)
        dirs[:] = [d for d in dirs if not d.startswith(".tiny-lm-check-")]
        for name in dirs + files:
            stat = (Path(root) / name).stat()
            seen.append((str((Path(root) / name).relative_to(folder)), stat.st_size, stat.st_mtime_ns))
    return sorted(seen)


def unchanged(folder: Path, before: list) -> bool:
    """Whether `folder` holds what `snapshot` saw `before`, asked again for a second where it does not: every command
    given the shared `trained` run as its output folder asks whether it can write there by making and removing an
    empty folder in it (00_errors' `cannot_write`), so another xdist worker's command can show one for a moment (CI
    once saw `.tiny-lm-check-6yqpsk1a`). A change that stays is still one."""
    for _ in range(5):
        if snapshot(folder) == before:
            return True
        time.sleep(0.2)
    return False


def test_train_writes_the_seed_layout(trained):
    out, r = trained
    for name in ["tokenizer.json", "model_config.json", "training_summary.json", "checkpoint_step_80",
                 "final_checkpoint/checkpoint_step_80", "final_checkpoint/tokenizer.json", "best_checkpoint/tokenizer.json"]:
        assert (out / name).exists(), name
    summary = json.loads((out / "training_summary.json").read_text())
    for key in ["final_loss", "best_loss", "total_steps", "total_time", "total_tokens", "avg_tokens_per_sec",
                "model_params", "output_dir", "final_val_loss", "final_val_bpb"]:
        assert key in summary, key
    assert set(summary["device_info"]) >= {"backend", "num_devices", "device_type", "devices"}
    assert summary["device_info"]["num_devices"] == 2
    assert summary["total_steps"] == 80 and summary["total_tokens"] == 80 * 8 * 32
    assert summary["final_val_loss"] < summary["unigram_val_loss"]
    assert "--- sample ---" in r["stdout"] and "trained tokenizer" in r["stdout"]


def test_another_architecture_is_refused_naming_each_field_and_nothing_changes(trained):
    """The CLI and the Python API, pointed at a finished run with another model: one error, every byte as it was."""
    out, _ = trained
    digest = lambda: {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*")) if p.is_file()}
    before = digest()
    changes = "d_model saved 32, given 64; n_layer saved 1, given 2; d_ff saved 128, given 192"
    r = tiny_lm("train", "--output-dir", str(out), "--d-model", "64", "--num-layers", "2")
    assert r.returncode == 2 and [line for line in r.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: cannot continue {out} with another architecture: {changes}: leave those flags out to continue it, "
        "or pass another --output-dir (or --overwrite) to start a new run"], r.stderr
    code = ("from tiny_lm import Trainer, ModelConfig\n"
            f"Trainer(ModelConfig(seq_len=32, d_model=64, n_layer=2, n_head=2), output_dir={str(out)!r}).fit()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
        f"tiny_lm.errors.TinyLMError: cannot continue {out} with another architecture: {changes}: leave the model "
        "settings out to continue it, or pass another output_dir (or overwrite=True) to start a new run"), r.stderr
    assert digest() == before
    r = tiny_lm("train", "--output-dir", str(out), "--optimizer", "muon")  # the optimizer's state does not convert
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"error: {out} was trained with --optimizer adamw, not muon: leave --optimizer out to continue it, or pass "
        "another --output-dir (or --overwrite) to start a new run"), r.stderr
    assert digest() == before


def test_generate_prints_text(trained):
    out, _ = trained
    r = tiny_lm("generate", "--checkpoint", str(out), "--prompt", "ROMEO:", "--max-tokens", "30",
                "--temperature", "0.8", "--top-k", "50")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout.strip()) > len("ROMEO:")
    again = tiny_lm("generate", "--checkpoint", str(out), "--prompt", "ROMEO:", "--max-tokens", "30",
                    "--temperature", "0.8", "--top-k", "50")
    assert again.stdout == r.stdout  # same seed, same text


def test_python_api_loads_the_run(trained):
    out, _ = trained
    code = (f"from tiny_lm import load_checkpoint; import numpy as np\n"
            f"from tiny_lm.generate import generate\n"
            f"model, tok, cfg = load_checkpoint({str(out)!r})\n"
            f"logits = model(np.array([[1, 2, 3]]))\n"
            f"assert logits.shape == (1, 3, cfg.vocab_size), logits.shape\n"
            f"print(generate(model, tok, 'KING', max_new_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=1))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("KING")


def test_second_run_reuses_tokenizer_and_resume_continues(tmp_path):
    out = tmp_path / "output"
    assert tiny_lm("train", *SMALL, "--max-steps", "4", "--output-dir", str(out)).returncode == 0
    tok_before = (out / "tokenizer.json").read_bytes()
    second = tiny_lm("train", *SMALL, "--max-steps", "4", "--output-dir", str(out), "--overwrite")  # a new run, the same tokenizer
    assert second.returncode == 0, second.stderr
    assert "reusing tokenizer" in second.stdout
    assert (out / "tokenizer.json").read_bytes() == tok_before
    resumed = tiny_lm("train", "--resume-from", str(out), "--output-dir", str(out), "--max-steps", "8", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 4 of 8" in resumed.stdout
    assert json.loads((out / "training_summary.json").read_text())["total_steps"] == 8
    retrained = tiny_lm("train", *SMALL, "--max-steps", "4", "--output-dir", str(out), "--retrain-tokenizer", "--vocab-size", "320", "--overwrite")
    assert retrained.returncode == 0 and "trained tokenizer" in retrained.stdout


def test_python_dash_m_is_the_same_command():
    r = subprocess.run([sys.executable, "-m", "tiny_lm", "train", "--help"], capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 0 and "--dataset-id" in r.stdout and "--resume-from" in r.stdout


BAD_INPUT = {
    "missing path": (["--dataset-id", "/no/such/corpus.txt"], "does not exist"),
    "hub unreachable": (["--dataset-id", "someone/some-dataset"], "cannot reach the Hugging Face hub"),
    "missing column": (["--dataset-id", str(DATA / "speeches.jsonl")], "its columns are speaker, body, id"),
    "empty dataset": (["--dataset-id", "EMPTY"], "is empty"),
    "bad preset": (["--model-preset", "huge"], "invalid choice"),
    "vocab mismatch": (["--vocab-size", "999"], "--retrain-tokenizer"),
    "heads": (["--d-model", "30", "--num-heads", "4"], "not divisible"),
    "all-blank rows": (["--dataset-id", "BLANK"], "every row is empty or blank"),
    "binary file": (["--dataset-id", "BINARY"], "is not UTF-8 text"),
    "unknown extension": (["--dataset-id", "MARKDOWN"], "is not a .txt, .jsonl, .json, .parquet or .csv file"),
    "non-text column": (["--dataset-id", str(DATA / "speeches.jsonl"), "--text-column", "id"], "not text; its columns are speaker, body, id"),
    "seq-len beyond the corpus": (["--dataset-id", "TINY", "--seq-len", "4096", "--val-split", "0.5"], "smaller --seq-len"),
    "seq-len beyond the corpus, streamed": (["--dataset-id", "TINY", "--seq-len", "4096", "--use-streaming", "--val-split", "0.5"], "smaller --seq-len"),
    "corrupt parquet": (["--dataset-id", "BADPARQUET"], "cannot read"),
    "corrupt gzip": (["--dataset-id", "BADGZIP"], "cannot read"),
    "vocab flags clash": (["--auto-vocab-size"], "not both"),
    "shuffle buffer": (["--shuffle-buffer-size", "0"], "--shuffle-buffer-size must be at least 1"),
    "vocab range": (["--auto-vocab-size", "--min-vocab-size", "4096", "--max-vocab-size", "1024"], "--min-vocab-size"),
    "target too small": (["--target-params", "1000"], "too small to build"),
    "target and dims": (["--target-params", "500000"], "--target-params decides the shape"),
    "prefer depth alone": (["--prefer-depth"], "--prefer-depth applies to --target-params"),
    "kv heads": (["--num-kv-heads", "3"], "--num-kv-heads 3 does not divide --num-heads 2"),
    "dropout too high": (["--dropout-rate", "1"], "--dropout-rate must be in [0, 1)"),
    "dropout negative": (["--dropout-rate", "-0.1"], "--dropout-rate must be in [0, 1)"),
    "precision clash": (["--precision", "fp32", "--use-mixed-precision"], "--use-mixed-precision means --precision bf16"),
    "lora without a base": (["--use-lora"], "add --init-from RUN_DIR"),
    "lora flag without lora": (["--lora-rank", "4"], "--lora-rank applies to LoRA fine-tuning"),
    "init-from not a run": (["--init-from", "NOTARUN"], "is not a training run"),
    "init-from missing": (["--init-from", "/no/such/run"], "does not exist"),
    "mesh does not match the devices": (["--mesh", "data=3,fsdp=1"], "data × fsdp must equal 2"),
    "mesh axis unknown": (["--mesh", "model=2"], "is not of the form data=N,fsdp=M"),
    "processes without an id": (["--num-processes", "2"], "add --coordinator-address, --process-id"),
    "coordinator without a port": (["--coordinator-address", "localhost", "--num-processes", "2", "--process-id", "0"], "is not HOST:PORT"),
    "process id out of range": (["--coordinator-address", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"], "between 0 and --num-processes - 1 = 1"),
    "skipped steps": (["--max-skipped-steps", "0"], "--max-skipped-steps must be at least 1"),
    "cpu devices": (["--cpu-devices", "0"], "--cpu-devices must be at least 1"),
    "unknown profile": (["--profile", "a100"], "invalid choice: 'a100'"),
    "negative sample length": (["--sample-tokens", "-1"], "--sample-tokens must be 0 or more, got -1"),
    "unknown optimizer": (["--optimizer", "sgd"], "--optimizer 'sgd' is unknown: choose one of adamw, muon"),
    "unknown schedule": (["--lr-schedule", "linear"], "--lr-schedule 'linear' is unknown: choose one of cosine, wsd"),
    "decay fraction": (["--decay-fraction", "0"], "--decay-fraction must be in (0, 1], got 0.0"),
    "not a duration": (["--time-budget", "soon"], "'soon' is not a duration: give a number with a unit"),
    "empty budget": (["--time-budget", "0m"], "--time-budget must be more than 0, got 0.0"),
    "budget with cosine": (["--time-budget", "5m", "--lr-schedule", "cosine"], "with --lr-schedule wsd"),
}

def make_bad_files(tmp_path) -> dict:
    """The broken inputs of BAD_INPUT, made fresh for each case."""
    files = {"EMPTY": "empty.jsonl", "BLANK": "blank.jsonl", "BINARY": "binary.txt", "MARKDOWN": "notes.md",
             "TINY": "tiny.txt", "BADPARQUET": "bad.parquet", "BADGZIP": "bad.txt.gz"}
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": "   "}\n{"text": ""}\n' * 50)
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "notes.md").write_text("# notes\n")
    (tmp_path / "tiny.txt").write_text("a few words.\n\nand a few more.\n\n" * 3)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1" + b"\0" * 64 + b"PAR1")
    (tmp_path / "bad.txt.gz").write_bytes(b"\x1f\x8b\x08\x00garbage that is not deflate data")
    (tmp_path / "not_a_run").mkdir()
    files["NOTARUN"] = "not_a_run"
    return {k: str(tmp_path / v) for k, v in files.items()}


# these two depend on the process: its device count, and the hub's offline setting read when huggingface_hub loads
IN_A_SUBPROCESS = {"hub unreachable", "mesh does not match the devices"}


def in_process(*args) -> subprocess.CompletedProcess:
    """`tiny-lm ARGS` run by `main` in this process (on its JAX devices): its exit status and what it printed, as a
    subprocess would give them (an unexpected exception: status 1 and its traceback). Programs compiled here serve
    the next call (generation, evaluation) at once."""
    from tiny_lm.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's own errors leave by SystemExit, as they do from the console script
            code = e.code
        except Exception:
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(["tiny-lm", *args], code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_and_touches_nothing(trained, tmp_path, case):
    out, _ = trained
    args, message = BAD_INPUT[case]
    files = make_bad_files(tmp_path)
    args = [files.get(a, a) for a in args]
    if "--auto-vocab-size" in args and case != "vocab flags clash":
        args = [a for a in SMALL if a not in ("--vocab-size", "384")] + args  # SMALL sets --vocab-size
    before = snapshot(out)
    base = [] if "--auto-vocab-size" in args and case != "vocab flags clash" else SMALL
    if case in ("target too small", "prefer depth alone"):
        base = NO_DIMS
    argv = ["train", *base, "--max-steps", "5", "--output-dir", str(out), "--overwrite", *args]  # a new run: checked before it replaces anything
    r = tiny_lm(*argv, process=True) if case in IN_A_SUBPROCESS else in_process(*argv)
    code, err = r.returncode, r.stderr
    assert code == 2, (code, err)
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err  # argparse's own errors too: no fifty-line usage
    assert err.startswith("error: ")
    assert unchanged(out, before), sorted(set(snapshot(out)) ^ set(before))


def test_column_flag_fixes_the_missing_column(tmp_path):
    r = tiny_lm("train", *SMALL, "--dataset-id", str(DATA / "speeches.jsonl"), "--text-column", "body",
                "--val-split", "0.1", "--max-steps", "4", "--output-dir", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr


def test_parquet_folder_source(tmp_path):
    folder = tmp_path / "pq"
    folder.mkdir()
    (folder / "a.parquet").write_bytes((DATA / "speeches.parquet").read_bytes())
    r = tiny_lm("train", *SMALL, "--dataset-id", str(folder), "--val-split", "0.1", "--max-steps", "4",
                "--output-dir", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr


def test_hub_unreachable_without_offline_flag(tmp_path):
    """The real no-network path (no HF_HUB_OFFLINE): still one line, exit 2."""
    env = {k: v for k, v in ENV.items() if k != "HF_HUB_OFFLINE"}
    r = tiny_lm("train", *SMALL, "--dataset-id", "someone/some-dataset", "--output-dir", str(tmp_path / "o"), env=env)
    if r.returncode == 0:
        pytest.skip("this machine can reach the hub")
    assert r.returncode == 2 and ("cannot reach the Hugging Face hub" in r.stderr or "no dataset" in r.stderr), r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not os.environ.get("TINY_LM_DEFAULT_RUN"), reason="set TINY_LM_DEFAULT_RUN=1 to run the full default job (a few minutes)")
def test_default_run_beats_unigram(tmp_path):
    r = tiny_lm("train", "--output-dir", str(tmp_path / "output"), "--no-progress", timeout=600)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "output" / "training_summary.json").read_text())
    assert summary["final_val_loss"] < summary["unigram_val_loss"] - 1.0


def test_streamed_run_resumes_exactly(tmp_path):
    """Resuming a streamed 4-step run from its step-2 checkpoint (another worker count) ends with the parameters of the uninterrupted run."""
    flags = [*SMALL, "--use-streaming", "--num-workers", "2", "--shuffle-buffer-size", "32", "--save-every", "2", "--eval-every", "2"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    r = tiny_lm("train", *flags, "--max-steps", "4", "--output-dir", str(whole))
    assert r.returncode == 0, r.stderr
    assert "streaming: 2 encoder threads" in r.stdout
    shutil.copytree(whole, split)
    shutil.rmtree(split / "checkpoint_step_4")  # as if the machine had died after step 2
    resumed = tiny_lm("train", "--resume-from", str(split), "--output-dir", str(split), "--num-workers", "0",
                      "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 2 of 4" in resumed.stdout and "streaming: encoded on the reading thread" in resumed.stdout
    code = ("import numpy as np, jax, sys\nfrom flax import nnx\nfrom tiny_lm import load_checkpoint\n"
            "a, b = (nnx.state(load_checkpoint(p)[0]) for p in sys.argv[1:])\n"
            "assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))")
    check = subprocess.run([sys.executable, "-c", code, str(whole), str(split)], capture_output=True, text=True, env=ENV, timeout=120)
    assert check.returncode == 0, check.stderr
    summary = json.loads((split / "training_summary.json").read_text())
    # a fraction of the run's time (2 steps: the workers' start-up weighs, the more so as compiled programs come from the cache)
    assert 0 <= summary["data_wait_fraction"] < 1 and summary["bytes_per_token"] > 1


def test_auto_vocab_size_and_bytes_per_token(tmp_path):
    flags = [a for a in SMALL if a not in ("--vocab-size", "384")]
    r = tiny_lm("train", *flags, "--auto-vocab-size", "--min-vocab-size", "300", "--max-vocab-size", "1024",
                "--max-steps", "2", "--output-dir", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert "auto vocab size" in r.stdout
    chosen = json.loads((tmp_path / "o" / "model_config.json").read_text())["vocab_size"]
    assert 300 <= chosen <= 1024
    summary = json.loads((tmp_path / "o" / "training_summary.json").read_text())
    assert 1.5 < summary["bytes_per_token"] < 10


def test_foreign_tokenizer_without_our_end_of_text(tmp_path):
    """A tokenizer.json with '</s>' and no '<|endoftext|>': documents are separated by '</s>'."""
    code = ("from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers\nimport sys\n"
            "t = Tokenizer(models.BPE()); t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False); t.decoder = decoders.ByteLevel()\n"
            "tr = trainers.BpeTrainer(vocab_size=384, special_tokens=['</s>'], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())\n"
            "t.train_from_iterator([open(sys.argv[1]).read()], tr); t.save(sys.argv[2])")
    path = tmp_path / "foreign.json"
    subprocess.run([sys.executable, "-c", code, str(DATA / "tiny_shakespeare.txt"), str(path)], check=True, timeout=60)
    r = tiny_lm("train", *without(SMALL, "--vocab-size"), "--dataset-id", str(DATA / "speeches.jsonl"),  # its tokenizer:
                "--text-column", "body", "--val-split", "0.1", "--tokenizer-path", str(path),  # 384 tokens, as SMALL's
                "--max-steps", "4", "--output-dir", str(tmp_path / "o"))  # SMALL's 4-step programs
    assert r.returncode == 0, r.stderr
    assert "</s>" in r.stdout


def test_bench_data_prints_one_json_object():
    r = tiny_lm("bench", "data", "--dataset-id", str(DATA / "tiny_shakespeare.txt"), "--vocab-size", "320",
                "--seq-len", "32", "--batch-size", "8", "--num-workers", "2", "--tokens", "50000", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    for key in ["cached_tokens_per_sec", "streaming_tokens_per_sec", "encode_tokens_per_sec"]:
        assert result[key] > 0, key


def test_size_prints_one_json_object():
    r = tiny_lm("size", "--target-params", "5000000", "--prefer-depth", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    for key in ["params", "non_embedding_params", "d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff", "seq_len",
                "vocab_size", "flops_per_token", "train_memory_bytes", "fits"]:
        assert key in report, key
    assert abs(report["params"] / 5e6 - 1) <= 0.05 and report["d_model"] % 64 == 0
    nano = json.loads(tiny_lm("size", "--model-preset", "nano", "--json").stdout)
    assert abs(nano["params"] / 0.4e6 - 1) <= 0.10  # its label, 0.4M
    assert nano["fits"] is True and report["train_memory_bytes"] > 16 * report["params"]
    huge = tiny_lm("size", "--model-preset", "xlarge", "--batch-size", "4096")
    assert huge.returncode == 0 and "does not fit" in huge.stdout, huge.stdout


def test_train_with_target_params(tmp_path):
    r = tiny_lm("train", *NO_DIMS, "--target-params", "150000", "--max-steps", "2", "--output-dir", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "o" / "training_summary.json").read_text())
    assert abs(summary["model_params"] / 150_000 - 1) <= 0.05, summary["model_params"]  # 2 layers of 64: a quick compile


def test_grouped_query_attention_trains_and_generates(tmp_path):
    out = tmp_path / "o"
    r = tiny_lm("train", *GQA, "--max-steps", "4", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "model_config.json").read_text())["n_kv_head"] == 2
    g = tiny_lm("generate", "--checkpoint", str(out), "--prompt", "KING", "--max-tokens", "5")
    assert g.returncode == 0 and g.stdout.startswith("KING"), g.stderr


FINETUNE = ["--dataset-id", str(DATA / "speeches.jsonl"), "--text-column", "body", "--batch-size", "4",
            "--eval-every", "3", "--save-every", "3", "--no-progress"]


def test_speedrun_switches_train_continue_generate_fine_tune_and_export(tmp_path):
    """QK-norm, SwiGLU (no longer the default), zero-init, an untied head and a soft-cap: recorded, kept by a continued
    run given none of the flags, sampled from, fine-tuned with LoRA; the export refuses the soft-cap in one line."""
    out, switches = tmp_path / "o", ["--qk-norm", "--zero-init", "--untied-head", "--swiglu", "--logit-softcap", "15"]
    r = tiny_lm("train", *SMALL, *switches, "--max-steps", "4", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    assert "parameters, --swiglu, --qk-norm, --zero-init, --untied-head, --logit-softcap 15 |" in r.stdout
    recorded = json.loads((out / "model_config.json").read_text())
    expected = {"qk_norm": True, "zero_init": True, "tie_embeddings": False, "use_swiglu": True, "activation": "relu2",
                "logit_softcap": 15.0}
    assert {k: recorded[k] for k in expected} == expected
    r = tiny_lm("train", "--resume-from", str(out), "--output-dir", str(out), "--max-steps", "6", "--no-progress", "--sample-tokens", "0")
    assert r.returncode == 0 and "resumed" in r.stdout, r.stderr
    assert json.loads((out / "model_config.json").read_text()) == recorded
    g = tiny_lm("generate", "--checkpoint", str(out), "--prompt", "KING", "--max-tokens", "5")
    assert g.returncode == 0 and g.stdout.startswith("KING"), g.stderr
    r = tiny_lm("train", "--init-from", str(out), "--use-lora", "--lora-rank", "2", *FINETUNE, "--max-steps", "2",
                "--output-dir", str(tmp_path / "lora"))
    assert r.returncode == 0 and "with LoRA rank 2" in r.stdout, r.stderr
    e = tiny_lm("export", "--checkpoint", str(out), "--out", str(tmp_path / "hf"))
    assert e.returncode == 2 and e.stderr.strip().endswith("retrain without it (drop --logit-softcap)"), e.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("case", ["dims", "tokenizer", "same folder", "rank 0", "rank too big", "alpha", "both init and resume"])
def test_bad_fine_tuning_flags(trained, tmp_path, case):
    """Each is refused in one line, exit 2, before anything is written (base run and new folder untouched)."""
    out, _ = trained
    new = tmp_path / "new"
    args, message = {
        "dims": (["--d-model", "64"], "leave out --d-model"),
        "tokenizer": (["--vocab-size", "512"], "leave out --vocab-size"),
        "same folder": (["--output-dir", str(out)], "is the run --init-from reads"),
        "rank 0": (["--use-lora", "--lora-rank", "0"], "--lora-rank must be at least 1, got 0: 8 or 16 is usual"),
        "rank too big": (["--use-lora", "--lora-rank", "33"], "between 1 and the model width 32"),
        "alpha": (["--use-lora", "--lora-alpha", "0"], "--lora-alpha must be more than 0, got 0.0"),
        "both init and resume": (["--resume-from", str(out)], "give only one of them"),
    }[case]
    before = snapshot(out)
    r = in_process("train", "--init-from", str(out), *FINETUNE, "--max-steps", "2", "--output-dir", str(new), *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert unchanged(out, before) and not new.exists()


def test_lora_fine_tune_resume_merge_generate(trained, tmp_path):
    """LoRA from a trained run: adapters only train and are stored; kill-and-resume equals no interruption; merged == adapted."""
    out, _ = trained
    lora = ["--init-from", str(out), "--use-lora", "--lora-rank", "4", "--dropout-rate", "0.1", *FINETUNE]
    whole, split = tmp_path / "whole", tmp_path / "split"
    r = tiny_lm("train", *lora, "--max-steps", "6", "--merge-lora", "--output-dir", str(whole))
    assert r.returncode == 0, r.stderr
    assert "with LoRA rank 4" in r.stdout and "frozen base parameters" in r.stdout
    summary = json.loads((whole / "training_summary.json").read_text())
    # d_model 32, 2 heads (qkv 96 wide), d_ff 128, 1 layer: r · (d_in + d_out) over qkv, out, up, down (no gate)
    assert summary["trainable_params"] == 4 * ((32 + 96) + (32 + 32) + 2 * (32 + 128))
    assert summary["init_from"]["path"] == str(out.absolute()) and summary["merged_model"].endswith("merged")
    assert (whole / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()

    def array_bytes(folder):  # what the stored arrays take (Orbax's own index files vary in size from machine to machine)
        import math, numpy as np, orbax.checkpoint as ocp
        tree = ocp.StandardCheckpointer().metadata(folder).item_metadata
        return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in __import__("jax").tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape")))
    for item in ("model", "optimizer"):  # adapters (and their Adam moments) only
        assert array_bytes(whole / "checkpoint_step_6" / item) < array_bytes(out / "checkpoint_step_80" / item) / 4, item

    shutil.copytree(whole, split)
    shutil.rmtree(split / "checkpoint_step_6")  # the machine died after step 3
    r = tiny_lm("train", "--resume-from", str(split), "--output-dir", str(split), "--no-progress")
    assert r.returncode == 0 and "resumed" in r.stdout, r.stderr
    check = """
import sys, numpy as np, jax
from flax import nnx
from tiny_lm import load_checkpoint
a, b, m = (load_checkpoint(p)[0] for p in sys.argv[1:4])
for x, y in zip(jax.tree.leaves(nnx.state(a, nnx.LoRAParam)), jax.tree.leaves(nnx.state(b, nnx.LoRAParam))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
tokens = np.arange(1, 17)[None]
np.testing.assert_allclose(np.asarray(m(tokens)), np.asarray(a(tokens)), atol=1e-5)
assert m.cfg.lora_rank == 0 and a.cfg.lora_rank == 4
print("same")
"""
    r = subprocess.run([sys.executable, "-c", check, str(whole), str(split), str(whole / "merged")], capture_output=True, text=True, env=ENV)
    assert r.stdout.strip() == "same", r.stderr
    texts = [tiny_lm("generate", "--checkpoint", str(c), "--prompt", "Speak", "--max-tokens", "8", "--temperature", "0").stdout
             for c in (whole, whole / "merged")]
    assert texts[0] == texts[1] and texts[0].startswith("Speak"), texts


def test_full_fine_tune_and_precision_flag(trained, tmp_path):
    out, _ = trained
    r = tiny_lm("train", "--init-from", str(out), *FINETUNE, "--max-steps", "2", "--precision", "bf16", "--output-dir", str(tmp_path / "ft"))
    assert r.returncode == 0, r.stderr
    assert "fine-tuning all weights" in r.stdout and "compute: bfloat16" in r.stdout
    summary = json.loads((tmp_path / "ft" / "training_summary.json").read_text())
    assert summary["trainable_params"] == summary["model_params"]
    assert json.loads((tmp_path / "ft" / "model_config.json").read_text())["dtype"] == "bfloat16"


def test_size_measures_the_token_budget():
    r = tiny_lm("size", "--model-preset", "nano", "--batch-size", "4", "--measure", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["compute_optimal_tokens"] == 20 * report["params"] and report["measured_tokens_per_sec"] > 0
    assert report["compute_optimal_seconds"] == pytest.approx(report["compute_optimal_tokens"] / report["measured_tokens_per_sec"])
    gqa = json.loads(tiny_lm("size", "--target-params", "20000000", "--num-kv-heads", "2", "--json").stdout)
    assert gqa["num_kv_heads"] == 2 and abs(gqa["params"] / 2e7 - 1) <= 0.05


def test_every_flag_says_what_it_does_and_its_default(monkeypatch):
    """Each option of each `tiny-lm` command (and subcommand) has a help line naming its default."""
    import argparse
    from tiny_lm.cli import main

    class Built(Exception):
        pass

    def capture(self, *args, **kwargs):
        raise Built(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Built) as built:
        main([])
    missing, checked, parsers = [], 0, [built.value.args[0]]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.option_strings and action.dest != "help":
                checked += 1
                if "(default" not in (action.help or ""):
                    missing.append(f"{parser.prog} {action.option_strings[0]}")
    assert checked > 60 and not missing, (checked, missing)


def test_bench_train_prints_one_json_object(tmp_path):
    r = tiny_lm("bench", "train", "--d-model", "32", "--num-layers", "1", "--num-heads", "2", "--seq-len", "32", "--vocab-size", "257",
                "--batch-size", "2", "--steps", "20", "--json", "--trace", str(tmp_path / "trace"), env=AS_USERS)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, r.stdout
    result = json.loads(lines[0])
    for key in ["tokens_per_sec", "step_time_ms", "mfu", "peak_flops", "compile_s", "outside_step_fraction", "device", "config"]:
        assert key in result, key
    assert result["tokens_per_sec"] > 0 and 0 < result["mfu"] < 2 and 0 <= result["outside_step_fraction"] < 1
    assert result["tokens_per_step"] == 2 * 2 * 32  # per device × the 2 devices × seq_len
    assert result["step_temp_bytes"] > 0  # XLA's memory_analysis of the compiled step
    assert abs(result["step_time_ms"] - 1e3 * result["tokens_per_step"] / result["tokens_per_sec"]) < 1e-6
    assert result["device"]["num_devices"] == 2 and result["config"]["d_model"] == 32
    # --trace: the profiler's Perfetto file, and the compiled step's time by kind of op, per device and step
    trace = result["trace"]
    assert list((tmp_path / "trace").glob("plugins/profile/*/perfetto_trace.json.gz"))
    assert trace["step_ms"] > 0 and abs(sum(trace["by_kind"].values()) - 1) < 1e-6
    assert trace["by_kind"]["matmul"] > 0.05 and trace["by_kind"]["collective"] > 0  # the 2 CPU devices all-reduce their gradients
    assert "matmul" in {o["kind"] for o in trace["top_ops"]}
    assert all(o["ms"] > 0 and 0 < o["share"] <= 1 for o in trace["top_ops"]) and len(trace["top_ops"]) == 10
    bad = tiny_lm("bench", "train", "--steps", "0")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "at least 1" in bad.stderr
    (tmp_path / "file").write_text("x")
    bad = tiny_lm("bench", "train", "--trace", str(tmp_path / "file"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "is a file, not a folder" in bad.stderr


def test_metrics_and_loss_plot(trained):
    out, _ = trained
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [40, 80]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(10, 81, 10))
    assert all(r["tokens_per_sec"] > 0 and r["mfu"] > 0 and r["lr"] >= 0 and r["skipped"] == 0 for r in train)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "loss.png").stat().st_mtime_ns > (out / "metrics.jsonl").stat().st_mtime_ns  # drawn from every record
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["mesh"] == {"data": 2, "fsdp": 1} and summary["effective_batch_size"] == 8
    assert 0 < summary["mfu"] < 2 and 0 <= summary["outside_step_fraction"] < 1


def test_resume_on_other_devices_keeps_the_global_batch(tmp_path):
    """A run trained with a global batch of 6 on 2 devices resumes on 3 devices with 2 each, and refuses 4 devices with the nearest sizes."""
    out = tmp_path / "o"
    r = tiny_lm("train", *without(SMALL, "--batch-size"), "--batch-size", "3", "--max-steps", "2", "--save-every", "2", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    four = {**ENV, "XLA_FLAGS": xla_flags(4)}
    refused = tiny_lm("train", "--resume-from", str(out), "--output-dir", str(out), "--max-steps", "4", "--no-progress", env=four)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "a global batch of 6 sequences does not split over 4 devices: use 4 or 8" in refused.stderr
    three = {**ENV, "XLA_FLAGS": xla_flags(3)}
    resumed = tiny_lm("train", "--resume-from", str(out), "--output-dir", str(out), "--max-steps", "4", "--no-progress", env=three)
    assert resumed.returncode == 0, resumed.stderr
    assert "2 per device on these 3 devices" in resumed.stdout
    assert json.loads((out / "training_summary.json").read_text())["effective_batch_size"] == 6


def test_non_finite_gradients_stop_the_run_with_checkpoints_intact(tmp_path):
    """A learning rate that blows the model up: the updates with non-finite gradients are skipped, the run stops after
    --max-skipped-steps in a row with one line and exit 2, and its checkpoints load with finite weights."""
    out = tmp_path / "o"
    r = tiny_lm("train", *without(SMALL, "--save-every", "--eval-every"), "--learning-rate", "1e6", "--warmup-steps", "0",
                "--max-steps", "40", "--save-every", "2", "--eval-every", "100", "--log-every", "1", "--max-skipped-steps", "3",
                "--output-dir", str(out))
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "not finite for 3 steps in a row" in r.stderr and "Traceback" not in r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records][-3:] == [1, 2, 3]
    saved = sorted(out.glob("checkpoint_step_*"))
    assert saved
    code = ("import sys, numpy as np, jax\nfrom flax import nnx\nfrom tiny_lm import load_checkpoint\n"
            "model = load_checkpoint(sys.argv[1])[0]\n"
            "assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model)))")
    check = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=ENV, timeout=120)
    assert check.returncode == 0, check.stderr


CORES = {**ENV, "XLA_FLAGS": xla_flags()}  # no fake devices: tiny-lm splits the CPU into devices itself
USABLE = len(os.sched_getaffinity(0))


def test_cpu_split_into_devices_trains_like_one_device(tmp_path):
    """--cpu-devices 3 with a batch of 8: 2 of the 3 devices share it (3 does not divide 8); losses equal one device's."""
    runs = {}
    for n in ("1", "3"):
        out = tmp_path / n
        r = tiny_lm("train", *without(SMALL, "--batch-size", "--eval-every"), "--batch-size", "8", "--max-steps", "20",
                    "--eval-every", "10", "--log-every", "5", "--cpu-devices", n, "--output-dir", str(out), env=CORES)
        assert r.returncode == 0, r.stderr
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[n] = r.stdout, json.loads((out / "training_summary.json").read_text()), records
    stdout, summary, records = runs["3"]
    assert "training on the CPU, split into 3 devices that share each batch" in stdout
    assert "mesh: data=2 × fsdp=1 (2 devices) | effective batch: 8 on the CPU (shared by 2 of its devices) × 1 accumulation = 8 sequences" in stdout
    assert summary["device_info"]["cpu_cores_as_devices"] == 3 and summary["device_info"]["num_devices"] == 3
    assert summary["mesh"] == {"data": 2, "fsdp": 1} and summary["effective_batch_size"] == 8
    generated = tiny_lm("generate", "--checkpoint", str(tmp_path / "3"), "--prompt", "ROMEO:", "--max-tokens", "5", env=CORES)
    assert generated.returncode == 0 and generated.stdout.strip(), generated.stderr  # saved on 3 devices, read on 1
    one_stdout, one, one_records = runs["1"]
    assert one["device_info"]["cpu_cores_as_devices"] == 0 and one["device_info"]["num_devices"] == 1
    assert "8 per device × 1 device × 1 accumulation" in one_stdout
    losses = lambda rs, key: [(r["step"], round(r[key], 4)) for r in rs if key in r]
    assert len(losses(records, "loss")) == 4 and len(losses(records, "val_loss")) == 2
    for key in ("loss", "val_loss"):
        for (step, a), (step1, b) in zip(losses(records, key), losses(one_records, key)):
            assert step == step1 and abs(a - b) < 2e-4, (key, step, a, b)


def test_cpu_devices_default_to_the_usable_cores():
    """With no XLA_FLAGS and no --cpu-devices, bench train splits the CPU into one device per usable core."""
    r = tiny_lm("bench", "train", "--d-model", "32", "--num-layers", "1", "--num-heads", "2", "--seq-len", "32", "--vocab-size", "257",
                "--batch-size", "12", "--steps", "10", "--json", env=CORES)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["device"]["num_devices"] == USABLE
    assert result["device"]["cpu_cores_as_devices"] == (USABLE if USABLE > 1 else 0)
    assert result["mesh"]["data"] == max(d for d in range(1, USABLE + 1) if 12 % d == 0)
    assert result["tokens_per_step"] == 12 * 32  # --batch-size is the whole CPU's


def test_generate_batches_stops_and_equals_the_reference(trained):
    out, _ = trained
    three = in_process("generate", "--checkpoint", str(out), "--prompt", "ROMEO:", "--max-tokens", "12", "--num-samples", "3")
    assert three.returncode == 0, three.stderr
    assert [f"--- sample {i} of 3 ---" in three.stdout for i in (1, 2, 3)] == [True] * 3
    greedy = [in_process("generate", "--checkpoint", str(out), "--prompt", "ROMEO:", "--max-tokens", "60", "--temperature", "0", *flags)
              for flags in ([], ["--no-cache"])]
    assert greedy[0].returncode == 0 and greedy[0].stdout == greedy[1].stdout, (greedy[0].stderr, greedy[1].stdout)
    stopped = in_process("generate", "--checkpoint", str(out), "--prompt", "ROMEO:", "--max-tokens", "60", "--temperature", "0", "--stop", "\n")
    assert stopped.returncode == 0 and "\n" not in stopped.stdout.rstrip("\n")[len("ROMEO:"):]
    assert greedy[0].stdout.startswith(stopped.stdout.rstrip("\n"))
    long_prompt = "ROMEO: " * 40  # longer than the window of 32 tokens
    cut = in_process("generate", "--checkpoint", str(out), "--prompt", long_prompt, "--max-tokens", "5")
    assert cut.returncode == 0 and "generating from its last 32 tokens" in cut.stderr, cut.stderr


def test_eval_scores_bits_per_byte_as_training_did(trained):
    out, _ = trained
    r = in_process("eval", "--checkpoint", str(out), "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    summary = json.loads((out / "training_summary.json").read_text())
    assert abs(result["bits_per_byte"] - summary["final_val_bpb"]) < 1e-4  # the fixture's validation text fits one evaluation
    assert abs(result["perplexity"] - math.exp(result["loss"])) < 1e-6 * result["perplexity"]
    assert abs(result["bits_per_byte"] - result["loss"] / math.log(2) * result["tokens"] / result["bytes"]) < 1e-9
    assert 0 < result["bits_per_byte"] < 8 and result["tokens"] > 0
    whole = json.loads(in_process("eval", "--checkpoint", str(out), "--split", "train", "--max-examples", "20", "--json").stdout)
    assert whole["documents"] == 20 and whole["split"] == "train"
    other = in_process("eval", "--checkpoint", str(out), "--dataset-id", str(DATA / "speeches.jsonl"), "--text-column", "body")
    assert other.returncode == 0 and "bits per byte" in other.stdout, other.stderr


GEN_BAD = {
    "top-p zero": (["generate", "--top-p", "0"], "--top-p must be in (0, 1]"),
    "top-p above one": (["generate", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    "negative temperature": (["generate", "--temperature", "-1"], "--temperature must be 0"),
    "negative max tokens": (["generate", "--max-tokens", "-3"], "--max-tokens must be 0 or more"),
    "no samples": (["generate", "--num-samples", "0"], "--num-samples must be at least 1"),
    "missing checkpoint": (["generate", "--checkpoint", "/no/such/run"], "does not exist"),
    "not a run": (["eval", "--checkpoint", "NOTARUN"], "no checkpoint in"),
    "foreign tokenizer": (["generate", "--checkpoint", "FOREIGN"], "is not the tokenizer this checkpoint was trained with"),
    "eval stride": (["eval", "--stride", "0"], "--stride must be at least 1"),
    "eval stride too long": (["eval", "--stride", "33"], "longer than the model's window 32"),
    "eval missing data": (["eval", "--dataset-id", "/no/such/file.txt"], "does not exist"),
    "export format": (["export", "--out", "NEW", "--format", "gguf"], "unknown --format 'gguf'"),
    "export exists": (["export", "--out", "EXISTING"], "exists: pass --overwrite"),
    "export without out": (["export"], "needs --out DIR"),
    "bench negative tokens": (["bench", "generate", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    "eval unknown split": (["eval", "--split", "nosuchsplit"], "local files have a single split, 'train': leave out --split nosuchsplit"),
    # the range table (cli.FLAG_RANGES), checked by main before any slow work
    "no steps": (["train", "--max-steps", "0"], "--max-steps must be at least 1, got 0"),
    "negative warmup": (["train", "--warmup-steps", "-5"], "--warmup-steps must be 0 or more, got -5"),
    "zero learning rate": (["train", "--learning-rate", "0"], "--learning-rate must be more than 0, got 0.0"),
    "zero epochs": (["train", "--epochs", "0"], "--epochs must be more than 0"),
    "negative seed": (["train", "--seed", "-1"], "--seed must be 0 or more, got -1"),
    "negative clip": (["train", "--grad-clip", "-1"], "--grad-clip must be 0 or more"),
    "negative workers": (["train", "--num-workers", "-1"], "--num-workers must be 0 or more"),
    "tiny vocabulary": (["train", "--vocab-size", "100"], "--vocab-size must be at least 257, got 100: a byte-level tokenizer needs"),
    "zero lora alpha": (["train", "--lora-alpha", "0"], "--lora-alpha must be more than 0"),
    "negative top-k": (["generate", "--top-k", "-1"], "--top-k must be 0 or more"),
    "eval batch": (["eval", "--batch-size", "0"], "--batch-size must be at least 1"),
    "size batch": (["size", "--batch-size", "0"], "--batch-size must be at least 1"),
    "size vocabulary": (["size", "--vocab-size", "0"], "--vocab-size must be at least 1"),
    "bench train steps": (["bench", "train", "--steps", "0"], "--steps must be at least 1"),
    "bench data tokens": (["bench", "data", "--tokens", "0"], "--tokens must be at least 1"),
    "bench data workers": (["bench", "data", "--num-workers", "-2"], "--num-workers must be 0 or more"),
    "bench generate cores": (["bench", "generate", "--cpu-devices", "0"], "--cpu-devices must be at least 1"),
}


@pytest.mark.parametrize("case", list(GEN_BAD))
def test_generate_eval_export_bad_input(trained, tmp_path, case):
    """In this process (`in_process`: these fail before any compilation, so a start-up would be most of the cost)."""
    out, _ = trained
    args, message = GEN_BAD[case]
    (tmp_path / "not_a_run").mkdir()
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "config.json").write_text("{}")
    names = {"NOTARUN": tmp_path / "not_a_run", "EXISTING": tmp_path / "existing", "NEW": tmp_path / "new", "FOREIGN": tmp_path / "foreign"}
    if "FOREIGN" in args:  # the run with another tokenizer.json beside its checkpoints
        from tokenizers import Tokenizer, models
        shutil.copytree(out, tmp_path / "foreign")
        Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "foreign" / "tokenizer.json"))
    args = [str(names.get(a, a)) for a in args]
    if args[0] == "train":
        args += ["--output-dir", str(out)]
    elif args[0] not in ("bench", "size") and "--checkpoint" not in args:
        args += ["--checkpoint", str(out)]
    before = snapshot(out)
    r = in_process(*args)
    err = r.stderr
    assert r.returncode == 2, (r.returncode, err)
    assert message in err and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert unchanged(out, before) and not (tmp_path / "new").exists()
    assert (tmp_path / "existing" / "config.json").read_text() == "{}"


def test_bench_generate_cache_is_ten_times_faster():
    env = {**ENV, "XLA_FLAGS": ""}  # one CPU device, compiled as a laptop user's is
    # 128 new tokens, not the default 256: 14.6 times faster cached here (13.4 at 256), in 18 s instead of 24
    r = tiny_lm("bench", "generate", "--json", "--max-tokens", "128", env=env)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, r.stdout
    result = json.loads(lines[0])
    for key in ["cached_tokens_per_sec", "uncached_tokens_per_sec", "cached_batch8_tokens_per_sec"]:
        assert result[key] > 0, key
    assert result["seq_len"] == 128 and result["new_tokens"] == 128
    assert result["cached_tokens_per_sec"] >= 10 * result["uncached_tokens_per_sec"], result


def overwrite_with_random_bytes(step_folder: Path) -> None:
    """Every file of a step, its metadata and records included, overwritten in place with random bytes of at least its size."""
    rng = np.random.default_rng(0)
    for f in step_folder.rglob("*"):
        if f.is_file():
            f.write_bytes(rng.integers(0, 256, max(64, f.stat().st_size), dtype=np.uint8).tobytes())


DAMAGED_COMMANDS = {
    "generate": ["generate", "--checkpoint", "RUN", "--max-tokens", "5"],
    "eval": ["eval", "--checkpoint", "RUN", "--json"],
    "export": ["export", "--checkpoint", "RUN", "--out", "HF"],
    "inspect": ["inspect", "RUN", "--json"],
}


@pytest.mark.parametrize("command", list(DAMAGED_COMMANDS))
def test_damaged_newest_step_is_skipped_with_a_warning(trained, tmp_path, command):
    """The newest step's files overwritten with random bytes: each command warns, naming it, and uses the step before;
    a damaged step named on its own is one clear error."""
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)  # copies: the original's hard-linked final_checkpoint stays intact
    overwrite_with_random_bytes(run / "checkpoint_step_80")
    args = [{"RUN": str(run), "HF": str(tmp_path / "hf")}.get(a, a) for a in DAMAGED_COMMANDS[command]]
    r = in_process(*args)
    out, err = r.stdout, r.stderr
    assert r.returncode == 0, err
    assert f"warning: checkpoint_step_80 (UnicodeDecodeError) in {run} cannot be read (damaged): using step 40 instead" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    if command == "inspect":
        report = json.loads(out)
        states = {c["name"]: c["state"] for c in report["checkpoints"]}
        assert report["step"] == 40 and states["checkpoint_step_80"] == "damaged (cannot be read)", states
        assert states["checkpoint_step_40"] == "complete"
    if command == "eval":
        assert json.loads(out)["tokens"] > 0
    if command == "export":
        assert (tmp_path / "hf" / "model.safetensors").is_file()
    named = [str(run / "checkpoint_step_80") if a == str(run) else a for a in args]
    r = in_process(*named)
    err = r.stderr
    assert r.returncode == 2, (r.returncode, err)
    assert err.startswith(f"error: {run / 'checkpoint_step_80'} cannot be read (UnicodeDecodeError): it is damaged; pass the run folder"), err
    assert len(err.strip().splitlines()) == 1, err


def test_a_checkpoint_of_the_list_of_blocks_model_still_loads():
    """tests/data/old_run was saved when the model kept one entry per layer (`blocks.0.…`): `load_checkpoint` reads
    it into today's model (per layer, or stacked on a layer axis), every array as saved."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx
    from tiny_lm.checkpoint import load_checkpoint, stack_layers
    model, _, cfg = load_checkpoint(DATA / "old_run")
    saved = DATA.absolute() / "old_run" / "checkpoint_step_2" / "model"
    raw = ocp.StandardCheckpointer().restore(saved, jax.tree.map(lambda m: np.zeros(m.shape, m.dtype),
                                                                 ocp.StandardCheckpointHandler().metadata(saved)))
    named = lambda tree: {jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value"): np.asarray(x)
                          for p, x in jax.tree_util.tree_leaves_with_path(stack_layers(tree))}
    assert cfg.n_layer == 2 and sorted(raw["blocks"]) == ["0", "1"]
    loaded, kept = named(nnx.state(model)), named(raw)
    assert loaded.keys() == kept.keys() and "blocks.attn.qkv.kernel" in kept
    for name, x in kept.items():
        np.testing.assert_array_equal(loaded[name], x, err_msg=name)


def test_second_start_loads_the_compiled_steps(tmp_path):
    """--compile-cache: the first run keeps its compiled programs there; a second run of the same model loads every one
    of them and compiles nothing new (the cache gains no entry); --no-compile-cache with it is a mistake."""
    cache = tmp_path / "jax-cache"
    def run(out: str):
        r = tiny_lm("train", *SMALL, "--max-steps", "2", "--sample-tokens", "0", "--output-dir", str(tmp_path / out),
                    "--compile-cache", str(cache), process=True)  # a second start: a process of its own
        assert r.returncode == 0, r.stderr
        return sorted(p.name for p in cache.iterdir() if p.name.endswith("-cache")), json.loads(
            (tmp_path / out / "training_summary.json").read_text())["compile_seconds"]
    kept, first_compile = run("first")
    assert any(name.startswith("jit_train_step") for name in kept), kept
    again, second_compile = run("second")
    assert again == kept, set(again) ^ set(kept)
    print(f"first step's call: {first_compile:.2f} s compiling, {second_compile:.2f} s from the cache")
    r = tiny_lm("train", "--compile-cache", str(cache), "--no-compile-cache", "--output-dir", str(tmp_path / "x"))
    assert r.returncode == 2 and "not both" in r.stderr and not (tmp_path / "x").exists()


def test_output_piped_into_head_stops_quietly(trained):
    """The reader of tiny-lm's output goes away first (`tiny-lm inspect RUN | head`): tiny-lm stops quietly, status 141."""
    out, _ = trained
    p = subprocess.Popen(["tiny-lm", "inspect", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    p.stdout.close()  # before tiny-lm writes a byte: its first write finds the pipe broken
    stderr = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_a_copied_lora_run_finds_its_base_beside_it(trained, tmp_path):
    """A LoRA run and its base, copied side by side to another place (the originals gone): `generate`, `load_run` and a
    resume find the base relative to the run, checked by fingerprint, and say where it came from; without the base, one
    line that says where it looked and how to point at it."""
    out, _ = trained
    home, moved = tmp_path / "home", tmp_path / "elsewhere"
    shutil.copytree(out, home / "base", ignore=shutil.ignore_patterns("best_checkpoint", "final_checkpoint"))
    # test_lora_fine_tune_resume_merge_generate's flags: its compiled programs
    r = tiny_lm("train", "--init-from", str(home / "base"), "--use-lora", "--lora-rank", "4", "--dropout-rate", "0.1", *FINETUNE,
                "--max-steps", "6", "--output-dir", str(home / "lora"))
    assert r.returncode == 0, r.stderr
    shutil.copytree(home, moved)
    shutil.rmtree(home)  # the recorded absolute path is gone
    copy, base = moved / "lora", moved / "base"
    shutil.rmtree(copy / "checkpoint_step_6")  # and the run stopped after step 3: a resume has steps to train
    r = tiny_lm("generate", "--checkpoint", str(copy), "--prompt", "Speak", "--max-tokens", "4", "--temperature", "0")
    assert r.returncode == 0 and r.stdout.startswith("Speak"), r.stderr
    assert f"go on base run {copy / os.pardir / 'base'} step 80 (recorded relative to the LoRA run" in r.stderr, r.stderr

    r = tiny_lm("train", "--output-dir", str(copy), "--no-progress")
    assert r.returncode == 0 and "resumed" in r.stdout and f"go on base run {copy / os.pardir / 'base'}" in r.stdout, r.stderr

    from tiny_lm.checkpoint import load_run
    from tiny_lm.errors import TinyLMError
    hidden = tmp_path / "hidden"
    base.rename(hidden)
    with pytest.raises(TinyLMError, match="not found: tried") as e:
        load_run(copy)
    assert str(copy / os.pardir / "base") in str(e.value) and "\n" not in str(e.value)
    run = load_run(copy, base=hidden)
    assert run.step == 6 and run.base["path"] == str(hidden) and run.base["found"] == "the base folder given"


def shifted_text(path: Path, seed: int = 0) -> Path:
    """80 paragraphs of made-up words, the last 20 (the held-out tail of one text file) of other words than the first 60:
    the more a model learns the training text, the worse it scores the held-out tail, from the first steps on."""
    rng = np.random.default_rng(seed)
    first, last = [f"ba{c}" for c in "bcdfghjklm"], [f"ko{c}" for c in "npqrstvwxz"]
    paragraphs = [" ".join(rng.choice(words, 30)) for words, n in ((first, 60), (last, 20)) for _ in range(n)]
    path.write_text("\n\n".join(paragraphs))
    return path


def test_a_fine_tune_gets_the_dropout_its_passes_call_for(trained):
    """A base fine-tuned on a small text for many passes gets the plan's dropout, as a new model would: the plan's
    reason, its figure and the model it builds agree; --dropout-rate wins."""
    out, _ = trained
    flags = ["plan", "--init-from", str(out), "--dataset-id", str(DATA / "tiny_shakespeare.txt"), "--max-steps", "2000",
             "--json"]
    r = tiny_lm(*flags)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["epochs"] > 8 and plan["dropout_rate"] == plan["model"]["dropout_rate"] == 0.2, plan
    assert any(line.startswith("dropout 0.2: the data repeats") for line in plan["reasons"]), plan["reasons"]
    given = json.loads(tiny_lm(*flags, "--dropout-rate", "0.05").stdout)
    assert given["dropout_rate"] == given["model"]["dropout_rate"] == 0.05, given


def test_the_best_checkpoint_is_the_result_where_validation_rises(tmp_path):
    """A run whose validation loss rises after its first evaluation: its summary scores best_checkpoint/, generate,
    eval and export read it and say so on stderr; --last reads the newest step, and scores worse."""
    out = tmp_path / "run"
    flags = [*without(SMALL, "--dataset-id", "--vocab-size", "--eval-every", "--save-every"),
             "--dataset-id", str(shifted_text(tmp_path / "words.txt")), "--val-split", "0.25", "--vocab-size", "300",
             "--eval-every", "10", "--save-every", "10", "--max-steps", "40"]
    r = tiny_lm("train", *flags, "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["best_step"] < summary["total_steps"] == 40, summary  # the premise: validation rose after its best
    assert (summary["result"], summary["result_step"]) == ("best_checkpoint", summary["best_step"]), summary
    assert f"{out / 'best_checkpoint'} is the result" in r.stdout, r.stdout[-800:]
    best = tiny_lm("eval", "--checkpoint", str(out), "--json")
    assert best.returncode == 0, best.stderr
    assert f"validation loss was lowest at step {summary['best_step']}" in best.stderr and "--last" in best.stderr
    assert json.loads(best.stdout)["checkpoint"] == str(out / "best_checkpoint")
    # the summary's bits per byte are the result's, as eval scores it (the validation text fits one scoring)
    assert abs(json.loads(best.stdout)["bits_per_byte"] - summary["final_val_bpb"]) < 1e-4, summary
    assert f"bits per byte (step {summary['best_step']}'s, the best checkpoint's, on" in r.stdout, r.stdout[-800:]
    last = tiny_lm("eval", "--checkpoint", str(out), "--json", "--last")
    assert last.returncode == 0 and "note:" not in last.stderr, last.stderr
    assert json.loads(last.stdout)["bits_per_byte"] > json.loads(best.stdout)["bits_per_byte"]
    sampled = tiny_lm("generate", "--checkpoint", str(out), "--max-tokens", "5")
    assert sampled.returncode == 0 and "best_checkpoint" in sampled.stderr, sampled.stderr
    exported = tiny_lm("export", "--checkpoint", str(out), "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0 and f"exported {out / 'best_checkpoint'}" in exported.stdout, exported.stdout
