"""The notebook check (.ci/notebooks.py): no `../` in a notebook, and notebooks run from copies outside the
repository against the built wheel, skipping the cells nbdev_test skips."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "notebooks.py"
_spec = importlib.util.spec_from_file_location("ci_notebooks", SCRIPT)
notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(notebooks)


def write_nb(path: Path, *cells: str) -> Path:
    """A notebook of code cells (a cell starting with '# ' is markdown)."""
    def cell(src):
        if src.startswith("# "):
            return {"cell_type": "markdown", "metadata": {}, "source": src}
        return {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": src}
    nb = {"cells": [cell(c) for c in cells], "metadata": {"kernelspec": {"name": "python3", "language": "python",
          "display_name": "Python 3"}}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))
    return path


def check(*args, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_static_check_names_notebook_cell_and_path(tmp_path):
    nb = write_nb(tmp_path / "bad.ipynb", "# Title", "x = 1\n# a comment about ../elsewhere is fine",
                  "from pathlib import Path\ntext = Path('../tests/data/tiny_shakespeare.txt').read_text()")
    assert notebooks.static_check([nb]) == [
        f"{nb}, cell #3: reaches outside the notebook's folder for '../tests/data/tiny_shakespeare.txt'"]
    r = check("--static-only", nb)
    assert r.returncode == 1
    assert f"{nb}, cell #3: reaches outside the notebook's folder for '../tests/data/tiny_shakespeare.txt'" in r.stderr
    r = check(nb)  # without --static-only: it stops before building anything
    assert r.returncode == 1 and "holds every file" not in r.stdout, r.stdout


def test_static_check_passes_a_clean_notebook(tmp_path):
    nb = write_nb(tmp_path / "clean.ipynb", "print('...')\nx = [1, 2, ...]", "import os\nos.path.join('a', 'b')")
    assert notebooks.static_check([nb]) == []
    for src in ["open('../shared/x')", "os.chdir('..')", "p = Path('..') / 'tests'"]:
        assert notebooks.static_check([write_nb(tmp_path / "x.ipynb", src)]), src


def test_notebooks_run_outside_against_the_wheel(tmp_path):
    """One build and one run: a notebook that sees the wheel passes (its `#| slow` and `#| eval: false` cells that
    would fail are skipped), a notebook whose cell fails makes the check exit non-zero, naming it and the error."""
    good = write_nb(tmp_path / "good.ipynb",
                    "import os, shutil, subprocess, tiny_lm\nfrom pathlib import Path\n"
                    "from tiny_lm.data import lesson_text",
                    f"root = Path({str(ROOT)!r})\n"
                    "assert not Path(tiny_lm.__file__).is_relative_to(root), tiny_lm.__file__\n"
                    "assert lesson_text().stat().st_size == 59_804\n"
                    "assert sorted(os.listdir('.')) == ['bad.ipynb', 'good.ipynb'], os.listdir('.')",
                    "exe = shutil.which('tiny-lm')\nassert not Path(exe).is_relative_to(root) and "
                    "not Path(exe).is_relative_to(Path(os.sys.executable).parent), exe\n"
                    "r = subprocess.run(['tiny-lm', '--help'], capture_output=True, text=True)\n"
                    "assert r.returncode == 0 and 'train' in r.stdout, r.stderr",
                    "#| slow\nraise RuntimeError('a slow cell ran')",
                    "#| eval: false\nraise RuntimeError('an eval: false cell ran')")
    bad = write_nb(tmp_path / "bad.ipynb", "x = 1", "raise ValueError('the cell failed')")
    r = check(good, bad)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "holds every file of tiny_lm/" in r.stdout, r.stdout + r.stderr
    assert any(ln.startswith("ok") and ln.endswith("good.ipynb") for ln in r.stdout.splitlines()), r.stdout + r.stderr
    assert any(ln.startswith("FAIL") and ln.endswith("bad.ipynb") for ln in r.stdout.splitlines()), r.stdout
    assert "1 of 2 notebooks passed" in r.stdout
    assert ("notebooks: bad.ipynb failed outside the repository: cell #2: ValueError: the cell failed"
            in r.stderr), r.stderr
