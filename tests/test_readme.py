"""README.md is generated from nbs/index.ipynb, and .ci/run runs exactly the README's test command."""
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / 'README.md').read_text(encoding='utf-8')
TEST_COMMAND = 'python3 -m venv .venv && . .venv/bin/activate && pip install --no-compile -e ".[dev]" && bash tests/check.sh'
MAIN_COMMAND = 'python3 -m venv .venv && . .venv/bin/activate && pip install -e . && tiny-lm train'


def _load_readme_module():
    spec = importlib.util.spec_from_file_location('ci_readme', ROOT / '.ci' / 'readme.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


readme = _load_readme_module()


def test_readme_is_generated_from_index_notebook():
    assert README == readme.render_file(ROOT / 'nbs' / 'index.ipynb'), 'README.md is stale: run python .ci/readme.py'
    assert README.startswith(readme.HEADER + '\n')


def test_readme_holds_exactly_the_two_setup_commands():
    setup_lines = [line.strip() for line in README.splitlines() if line.strip().startswith('python3 -m venv')]
    assert setup_lines == [MAIN_COMMAND, TEST_COMMAND]
    assert readme.main_command(README) == MAIN_COMMAND
    assert readme.test_command(README) == TEST_COMMAND
    assert 'tiny-lm train' in MAIN_COMMAND


def test_ci_run_extracts_the_readme_test_command():
    out = subprocess.run(['python3', str(ROOT / '.ci' / 'readme.py'), '--test-command'],
                         capture_output=True, text=True, check=True)
    assert out.stdout == TEST_COMMAND + '\n'


def test_ci_run_evaluates_whatever_the_readme_says(tmp_path):
    "Run .ci/run in a scratch copy whose README's test command only leaves a trace."
    (tmp_path / '.ci').mkdir()
    for name in ('run', 'readme.py'):
        shutil.copy(ROOT / '.ci' / name, tmp_path / '.ci' / name)
    command = 'echo "$PWD" > ran.txt && echo ok'
    (tmp_path / 'README.md').write_text(f'# x\n\n{readme.TEST_MARKER}\n```bash\n{command}\n```\n', encoding='utf-8')
    out = subprocess.run(['bash', str(tmp_path / '.ci' / 'run')], cwd='/', capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f'+ {command}\nok\n'
    assert (tmp_path / 'ran.txt').read_text().strip() == str(tmp_path)  # ran from the repo root

    (tmp_path / 'README.md').write_text(f'{readme.TEST_MARKER}\n```bash\nfalse && echo never\n```\n')
    out = subprocess.run(['bash', str(tmp_path / '.ci' / 'run')], capture_output=True, text=True)
    assert out.returncode != 0 and out.stdout == '+ false && echo never\n'  # a failing command fails the run


@pytest.mark.parametrize('text, problem', [
    ('no marker at all', 'exactly once'),
    ('<!-- test-command -->\n\nplain text\n', 'followed by a ```bash block'),
    ('<!-- test-command -->\n```bash\necho a\necho b\n```\n', 'one command line, found 2'),
    ('<!-- test-command -->\n```bash\necho a\n', 'not closed'),
])
def test_test_command_refuses_a_malformed_readme(text, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        readme.test_command(text)


def test_render_rules():
    nb = {'cells': [
        {'cell_type': 'markdown', 'source': ['# t\n', '\n', '> sub']},
        {'cell_type': 'code', 'source': '#| hide\nimport secret', 'outputs': []},
        {'cell_type': 'code', 'source': '#| eval: false\nx = 1\nx', 'outputs': [
            {'output_type': 'execute_result', 'data': {'text/plain': ['1']}, 'metadata': {}, 'execution_count': 1}]},
        {'cell_type': 'code', 'source': 'print("hi")', 'outputs': [{'output_type': 'stream', 'name': 'stdout', 'text': 'hi\n'}]},
    ]}
    assert readme.render(nb) == (f'{readme.HEADER}\n\n# t\n\n> sub\n\n```python\nx = 1\nx\n```\n\n```\n1\n```\n\n'
                                 '```python\nprint("hi")\n```\n\n```\nhi\n```\n')


def test_index_notebook_exports_nothing():
    nb = json.loads((ROOT / 'nbs' / 'index.ipynb').read_text(encoding='utf-8'))
    for cell in nb['cells']:
        source = ''.join(cell['source'])
        assert not re.search(r'^\s*#\s*\|\s*(export|exporti|exports|default_exp)\b', source, re.M), source


def test_every_numbered_notebook_has_a_row_and_a_colab_badge():
    for nb in sorted(ROOT.glob('nbs/[0-9][0-9]*.ipynb')):
        badge = f'https://colab.research.google.com/github/tiny-lm/tiny_lm/blob/main/nbs/{nb.name}'
        assert f'[{nb.stem}](nbs/{nb.name})' in README and badge in README, f'{nb.name} missing from README'


def test_every_linked_notebook_exists():
    linked = set(re.findall(r'\bnbs/([\w-]+\.ipynb)', README))
    assert linked, 'README links no notebook'
    missing = sorted(name for name in linked if not (ROOT / 'nbs' / name).exists())
    assert not missing, f'README links notebooks that do not exist: {missing}'
