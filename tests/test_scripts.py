"""tiny_lm used as its users use it outside the repository: the seeds' Python API in a plain script with no
`if __name__ == "__main__":` guard (run as a file and from stdin), and a tokenizer worker killed in the middle of a run.
Neither may hang: every failure is one clear error within seconds."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_cli import DATA, ENV, tiny_lm  # noqa: F401  (the same environment as the CLI tests)

SCRIPT = """
from tiny_lm import Trainer, ModelConfig, TrainConfig, DataConfig, TokenizerConfig

model_cfg = ModelConfig(seq_len=32, d_model=32, n_layer=1, n_head=2)
# test_data's small-source fits train this model with these settings on one device too: one compile serves both
train_cfg = TrainConfig(batch_size=2, max_steps=2, eval_every=2, save_every=2, warmup_steps=1, eval_batches=2)
data_cfg = DataConfig(dataset_id={folder!r}, num_workers=2, streaming={streaming})
summary = Trainer(model_cfg, train_cfg, data_config=data_cfg, output_dir={out!r}, tokenizer_config=TokenizerConfig(vocab_size=300),
                  progress=False, sample_tokens=0).fit()
print("FIT RETURNED", summary["total_steps"])
"""


def corpus_folder(tmp_path: Path) -> Path:
    """A local text folder, as the multi-GPU guide's users train on: two files of the Shakespeare fixture."""
    folder = tmp_path / "texts"
    folder.mkdir()
    text = (DATA / "tiny_shakespeare.txt").read_text()
    (folder / "a.txt").write_text(text[: len(text) // 2])
    (folder / "b.txt").write_text(text[len(text) // 2:])
    return folder


@pytest.mark.parametrize("how", ["python script.py (cached tokens)", "python - < script.py (streaming)"])
def test_seed_script_without_main_guard_finishes(tmp_path, how):
    """Each tokenizer worker is a fresh interpreter that never imports the user's script: the run trains once and returns."""
    streaming = "streaming" in how
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT.format(folder=str(corpus_folder(tmp_path)), streaming=streaming, out=str(tmp_path / "out")))
    env = {**ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    if streaming:
        r = subprocess.run([sys.executable, "-"], stdin=script.open(), capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    else:
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("FIT RETURNED 2") == 1, r.stdout  # once: no worker ran the script again
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (tmp_path / "out" / "final_checkpoint").is_dir()


def encoder_workers(pid: int) -> list[int]:
    """The tokenizer worker processes started by process `pid`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"serve_encoder" in cmdline:
            found.append(int(proc.name))
    return found


def test_worker_killed_mid_run_is_one_error_in_seconds(tmp_path):
    """A streaming run whose tokenizer worker is killed (the OOM killer, say) stops with one line that says so, at once,
    and the checkpoint it saved before is intact."""
    out = tmp_path / "out"
    args = ["tiny-lm", "train", "--dataset-id", str(corpus_folder(tmp_path)), "--use-streaming", "--num-workers", "2",
            "--vocab-size", "384", "--seq-len", "32", "--d-model", "32", "--num-layers", "1", "--num-heads", "2",
            "--batch-size", "4", "--max-steps", "100000", "--save-every", "20", "--log-every", "1", "--no-progress",
            "--output-dir", str(out)]  # the model, batch and steps of test_faults' open-ended runs: their compiled programs
    run = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.time() + 120
        while not (out / "checkpoint_step_20").is_dir() and time.time() < deadline and run.poll() is None:
            time.sleep(0.2)
        workers = encoder_workers(run.pid)
        assert run.poll() is None and len(workers) == 2, (run.poll(), workers)
        os.kill(workers[0], signal.SIGKILL)
        killed = time.time()
        _, stderr = run.communicate(timeout=60)
        assert time.time() - killed < 20, "the run took too long to notice its dead worker"
    finally:
        run.kill()
    assert run.returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr and stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1, stderr[-3000:]
    assert f"tokenizer worker {workers[0]} was killed by signal 9" in stderr
    assert not encoder_workers(run.pid)  # the other worker is stopped too
