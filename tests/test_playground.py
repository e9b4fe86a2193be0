"""`playground` over a real run folder: the widgets load its checkpoint and drive `generate` with their settings."""
import subprocess
import sys

from test_cli import ENV, SMALL, tiny_lm

DRIVE = """
import sys
from tiny_lm.checkpoint import load_checkpoint
from tiny_lm.generate import generate
from tiny_lm.show import playground
out = sys.argv[1]
pg = playground(out, prompt="KING", max_new_tokens=20)
shown = []
pg.output.observe(lambda change: shown.append(change["new"]), names="value")
pg.temperature.value, pg.top_k.value, pg.top_p.value, pg.seed.value = 1.2, 20, 0.9, 4
pg.button.click()
model, tok, _ = load_checkpoint(out)
expected = generate(model, tok, "KING", 20, temperature=1.2, top_k=20, top_p=0.9, seed=4)
assert pg.output.value == expected, pg.output.value
assert pg.output.value.startswith("KING") and len(pg.output.value) > 4 and len(shown) > 2, shown
print("ok", repr(pg.output.value))
"""


def test_playground_over_a_run_folder(tmp_path):
    out = tmp_path / "output"
    r = tiny_lm("train", *SMALL, "--max-steps", "10", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", DRIVE, str(out)], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok 'KING"), r.stdout
