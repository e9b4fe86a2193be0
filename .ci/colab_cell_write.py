"""Write the Colab set-up cells, .ci/colab_cell.md and .ci/colab_cell.py, into cells 1 and 2 of every notebook.

    python .ci/colab_cell_write.py            # write them (cell ids and everything else kept)
    python .ci/colab_cell_write.py --check    # exit 1, naming each notebook whose cells differ
    python .ci/colab_cell_write.py --nbs DIR  # the notebooks of another folder (default: nbs/)

Every notebook of nbs/ has them (cell 0 is its title), except index.ipynb, which becomes the README, and scratch
notebooks (`_name.ipynb`). The cell's own pins must match settings.ini: its `JAX_MIN` the `jax>=` requirement and
its `TINY_LM` the repository's `git_url`. Standard library only, like readme.py.
"""
import argparse
import configparser
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKDOWN = (ROOT / '.ci' / 'colab_cell.md').read_text(encoding='utf-8').rstrip('\n')
CODE = (ROOT / '.ci' / 'colab_cell.py').read_text(encoding='utf-8').rstrip('\n')


def notebooks(nbs: Path) -> list[Path]:
    "The notebooks that open with the Colab cells."
    return sorted(p for p in nbs.rglob('*.ipynb') if p.name != 'index.ipynb' and not p.name.startswith('_')
                  and '.ipynb_checkpoints' not in p.parts)


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def with_cells(nb: dict, path: Path) -> dict:
    "`nb` with the Colab cells as cells 1 and 2: only their source changes (and the code cell's outputs go)."
    cells = nb['cells']
    if (len(cells) < 3 or cells[1]['cell_type'] != 'markdown' or cells[2]['cell_type'] != 'code'
            or not ''.join(cells[2]['source']).startswith('#| eval: false')):
        raise SystemExit(f'{path}: cells 1-2 are not the Colab cells (a markdown cell, then a code cell that '
                         'starts with `#| eval: false`); put them back after the title, then run this again')
    cells[1] = {**cells[1], 'source': _lines(MARKDOWN)}
    cells[2] = {**cells[2], 'execution_count': None, 'outputs': [], 'source': _lines(CODE)}
    return nb


def _dump(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + '\n'  # nbdev_clean's layout, so it changes nothing


def pin_mismatches(settings: Path = ROOT / 'settings.ini') -> list[str]:
    "What in the cell disagrees with settings.ini."
    config = configparser.ConfigParser()
    config.read(settings, encoding='utf-8')
    jax_pin = re.search(r'(?:^|\s)jax>=([\w.]+)', config['DEFAULT']['requirements']).group(1)
    git_url = config['DEFAULT']['git_url']
    problems = []
    if f'JAX_MIN = "{jax_pin}"' not in CODE:
        problems.append(f'settings.ini requires jax>={jax_pin}: set JAX_MIN = "{jax_pin}" in .ci/colab_cell.py')
    if f' @ git+{git_url}"' not in CODE:
        problems.append(f'settings.ini has git_url = {git_url}: install tiny_lm from it in .ci/colab_cell.py')
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--check', action='store_true', help='change nothing; exit 1 if a notebook is stale')
    parser.add_argument('--nbs', type=Path, default=ROOT / 'nbs', help='the folder of notebooks')
    args = parser.parse_args(argv)
    problems = pin_mismatches()
    for problem in problems:
        print(f'colab cell: {problem}', file=sys.stderr)
    stale = []
    for path in notebooks(args.nbs):
        old = path.read_text(encoding='utf-8')
        new = _dump(with_cells(json.loads(old), path))
        if new != old:
            stale.append(path)
            if not args.check:
                path.write_text(new, encoding='utf-8')
    if args.check and stale:
        names = ', '.join(str(p.relative_to(args.nbs.parent)) for p in stale)
        print(f'colab cell: cells 1-2 differ from .ci/colab_cell.md and .ci/colab_cell.py in {names}; '
              'run python .ci/colab_cell_write.py and commit the notebooks', file=sys.stderr)
    elif stale:
        print(f'colab cell: wrote {len(stale)} notebook(s)')
    return 1 if problems or (args.check and stale) else 0


if __name__ == '__main__':
    sys.exit(main())
