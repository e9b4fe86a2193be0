"""Write README.md from nbs/index.ipynb without Quarto, and read the README's commands back.

    python3 .ci/readme.py                  # (re)write README.md
    python3 .ci/readme.py --test-command   # print the README's test command (what .ci/run runs)
    python3 .ci/readme.py --main-command   # print the README's main-job command

Standard library only: .ci/run calls it on a fresh machine before any virtual environment exists.
Rendering rules: markdown and raw cells are copied verbatim; a code cell is shown as a ```python
block with its `#|` directive lines removed, followed by its text outputs in a plain ``` block;
`#| hide` drops a cell, `#| echo: false` drops its code, `#| output: false` drops its outputs.
"""
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / 'nbs' / 'index.ipynb'
README = ROOT / 'README.md'
HEADER = '<!-- generated from nbs/index.ipynb by .ci/readme.py: do not edit -->'
TEST_MARKER = '<!-- test-command -->'
MAIN_MARKER = '<!-- main-command -->'

_DIRECTIVE = re.compile(r'^\s*#\s*\|\s*([\w-]+)\s*:?\s*(.*?)\s*$')  # `#| name: value` or `#| name value`


def _source(cell: dict) -> str:
    src = cell.get('source', '')
    return ''.join(src) if isinstance(src, list) else src


def _directives(code: str) -> tuple[dict[str, str], str]:
    """Split a code cell into its `#|` directives (name -> value) and the remaining code."""
    directives, body = {}, []
    for line in code.splitlines():
        m = _DIRECTIVE.match(line)
        if m:
            directives[m.group(1).lower()] = m.group(2).lower()
        else:
            body.append(line)
    return directives, '\n'.join(body).strip('\n')


def _text_outputs(cell: dict) -> str:
    texts = []
    for out in cell.get('outputs', []):
        if out.get('output_type') == 'stream':
            texts.append(_source({'source': out.get('text', '')}))
        elif out.get('output_type') in ('execute_result', 'display_data'):
            plain = out.get('data', {}).get('text/plain')
            if plain is not None:
                texts.append(_source({'source': plain}) + '\n')
        elif out.get('output_type') == 'error':
            texts.append(f"{out.get('ename', 'Error')}: {out.get('evalue', '')}\n")
    return ''.join(texts).strip('\n')


def _render_code(cell: dict) -> list[str]:
    directives, code = _directives(_source(cell))
    if 'hide' in directives or directives.get('include') == 'false':
        return []
    parts = []
    if code and directives.get('echo') != 'false':
        parts.append(f'```python\n{code}\n```')
    outputs = _text_outputs(cell)
    if outputs and directives.get('output') != 'false':
        parts.append(f'```\n{outputs}\n```')
    return parts


def render(nb: dict) -> str:
    """README text for the notebook `nb` (a parsed .ipynb JSON dict)."""
    parts = [HEADER]
    for cell in nb.get('cells', []):
        if cell.get('cell_type') == 'code':
            parts.extend(_render_code(cell))
        else:
            text = _source(cell).strip('\n')
            if text:
                parts.append(text)
    return '\n\n'.join(p.rstrip() for p in parts) + '\n'


def render_file(path: Path = NOTEBOOK) -> str:
    return render(json.loads(path.read_text(encoding='utf-8')))


def _command_after(readme_text: str, marker: str) -> str:
    lines = readme_text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == marker]
    if len(starts) != 1:
        raise ValueError(f'README must contain the line {marker!r} exactly once (found {len(starts)})')
    rest = lines[starts[0] + 1:]
    while rest and not rest[0].strip():
        rest.pop(0)
    if not rest or rest[0].strip() not in ('```bash', '```sh'):
        raise ValueError(f'{marker!r} must be followed by a ```bash block')
    try:
        end = next(i for i, line in enumerate(rest[1:], 1) if line.strip() == '```')
    except StopIteration:
        raise ValueError(f'the ```bash block after {marker!r} is not closed') from None
    commands = [line.strip() for line in rest[1:end] if line.strip() and not line.strip().startswith('#')]
    if len(commands) != 1:
        raise ValueError(f'the ```bash block after {marker!r} must hold one command line, found {len(commands)}')
    return commands[0]


def test_command(readme_text: str) -> str:
    """The single command line in the ```bash block right after `<!-- test-command -->`."""
    return _command_after(readme_text, TEST_MARKER)


def main_command(readme_text: str) -> str:
    """The single command line in the ```bash block right after `<!-- main-command -->`."""
    return _command_after(readme_text, MAIN_MARKER)


test_command.__test__ = main_command.__test__ = False  # not pytest tests, despite the name


def main(argv: list[str]) -> int:
    if argv == ['--test-command']:
        print(test_command(README.read_text(encoding='utf-8')))
    elif argv == ['--main-command']:
        print(main_command(README.read_text(encoding='utf-8')))
    elif not argv:
        text = render_file()
        test_command(text), main_command(text)  # refuse to write a README that .ci/run cannot read
        with open(README, 'w', encoding='utf-8', newline='\n') as f:
            f.write(text)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
