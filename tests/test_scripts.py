"""tiny_lm used as its users use it outside the repository: the seeds' Python API in a plain script with no
`if __name__ == "__main__":` guard (run as a file and from stdin): it must train once and return."""
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli import DATA, ENV, tiny_lm, xla_flags  # noqa: F401  (the same environment as the CLI tests)

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
    """Encoding runs on threads of this process, which never import the user's script: the run trains once and returns."""
    streaming = "streaming" in how
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT.format(folder=str(corpus_folder(tmp_path)), streaming=streaming, out=str(tmp_path / "out")))
    env = {**ENV, "XLA_FLAGS": xla_flags(1)}
    if streaming:
        r = subprocess.run([sys.executable, "-"], stdin=script.open(), capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    else:
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("FIT RETURNED 2") == 1, r.stdout  # once: nothing ran the script again
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (tmp_path / "out" / "final_checkpoint").is_dir()

