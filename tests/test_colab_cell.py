"""The Colab set-up cell (.ci/colab_cell.py) on simulated runtimes, its pip calls recorded rather than run, and the
writer that copies it into cells 1-2 of every notebook (.ci/colab_cell_write.py)."""
import importlib.util
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CELL = (ROOT / '.ci' / 'colab_cell.py').read_text(encoding='utf-8')
WRITER = ROOT / '.ci' / 'colab_cell_write.py'
TINY_LM = 'tiny_lm[cloud] @ git+https://github.com/tiny-lm/tiny_lm'
NEW = '0.10.2'  # the JAX a simulated install brings
JAX_BUILDS = {'tpu': 'jax[tpu]>=0.10', 'gpu': 'jax[cuda12]>=0.10', 'cpu': 'jax>=0.10'}


class FakeSubprocess:
    "Stands in for `subprocess` in the cell: answers its JAX query from `jax` and records pip's arguments."

    def __init__(self, jax, after=None):
        self.jax, self.after, self.pip, self.queries = jax, after, [], 0

    def run(self, args, **kwargs):
        assert args[0] == sys.executable and 'import jax' in args[-1], args
        self.queries += 1
        if self.jax is None:
            return types.SimpleNamespace(returncode=1, stdout='', stderr="ModuleNotFoundError: No module named 'jax'")
        return types.SimpleNamespace(returncode=0, stdout=' '.join(self.jax) + '\n', stderr='a warning\n')

    def check_call(self, args):
        assert args[:3] == [sys.executable, '-m', 'pip'], args
        self.pip.append(args[3:])
        if self.after is not None:
            self.jax = self.after
        return 0


def run_cell(monkeypatch, fake, colab):
    "Execute the cell as a fresh notebook session would, with `fake` as its subprocess; return the names it defined."
    with monkeypatch.context() as m:
        m.setitem(sys.modules, 'subprocess', fake)
        if colab:
            m.setitem(sys.modules, 'google.colab', types.ModuleType('google.colab'))
        else:
            m.delitem(sys.modules, 'google.colab', raising=False)
        m.delitem(sys.modules, 'jax', raising=False)
        namespace = {}
        exec(compile(CELL, str(WRITER.parent / 'colab_cell.py'), 'exec'), namespace)
    return namespace


def fake_jax(version, backend):
    "A JAX module this session already imported."
    return types.SimpleNamespace(__version__=version, default_backend=lambda: backend)


def machine(root: Path, *files: tuple[str, str]) -> Path:
    "A simulated machine: `files` (path under `root`, text) written under `root`."
    for name, text in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


PCI = 'sys/bus/pci/devices/0000:00:04.0'
TPU_V5E = ((f'{PCI}/vendor', '0x1ae0\n'), (f'{PCI}/device', '0x0063\n'))
GPU = (('proc/driver/nvidia/version', 'NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15\n'),)
RUNTIMES = {
    'tpu v5e on the PCI bus': (TPU_V5E, 'tpu'),
    'tpu v6e on the PCI bus': (((f'{PCI}/vendor', '0x1ae0\n'), (f'{PCI}/device', '0x006f\n')), 'tpu'),
    'google network card, no tpu': (((f'{PCI}/vendor', '0x1ae0\n'), (f'{PCI}/device', '0x0042\n')), 'cpu'),
    'old tpu driver': ((('dev/accel0', ''),), 'tpu'),
    'tpu through vfio': ((('dev/vfio/0', ''), ('dev/vfio/vfio', '')), 'tpu'),
    'vfio without a device': ((('dev/vfio/vfio', ''),), 'cpu'),
    'nvidia driver': (GPU, 'gpu'),
    'nvidia device file': ((('dev/nvidia0', ''),), 'gpu'),
    'virtio devices only': (((f'{PCI}/vendor', '0x1af4\n'), (f'{PCI}/device', '0x1041\n')), 'cpu'),
    'nothing': ((), 'cpu'),
}


@pytest.mark.parametrize('name', RUNTIMES)
def test_runtime_is_found_where_jax_looks(monkeypatch, tmp_path, name):
    files, expected = RUNTIMES[name]
    cell = run_cell(monkeypatch, FakeSubprocess(None), colab=False)
    assert cell['runtime'](str(machine(tmp_path, *files))) == expected


SCENARIOS = {  # the machine, its runtime, the installed JAX, what a new JAX sees -> the JAX pip is given (None: kept)
    'colab tpu, its jax fits': (TPU_V5E, 'tpu', (NEW, 'tpu'), None, None),
    'tpu, jax too old': (TPU_V5E, 'tpu', ('0.4.38', 'tpu'), (NEW, 'tpu'), 'jax[tpu]>=0.10'),
    'tpu, jax sees only the cpu': (TPU_V5E, 'tpu', (NEW, 'cpu'), (NEW, 'tpu'), 'jax[tpu]>=0.10'),
    'gpu, no jax': (GPU, 'gpu', None, (NEW, 'gpu'), 'jax[cuda12]>=0.10'),
    'gpu, jax fits': (GPU, 'gpu', ('0.10.0', 'gpu'), None, None),
    'cpu, jax too old': ((), 'cpu', ('0.4.33', 'cpu'), (NEW, 'cpu'), 'jax>=0.10'),
    'cpu, jax fits': ((), 'cpu', ('0.11.0', 'cpu'), None, None),
}


@pytest.mark.parametrize('name', SCENARIOS)
def test_jax_is_installed_only_when_the_installed_one_does_not_fit(monkeypatch, tmp_path, capsys, name):
    files, device, installed, after, jax_install = SCENARIOS[name]
    fake = FakeSubprocess(installed, after)
    cell = run_cell(monkeypatch, fake, colab=False)
    assert fake.pip == [] and fake.queries == 0  # off Colab the cell only defines its functions
    monkeypatch.delitem(sys.modules, 'jax', raising=False)
    cell['set_up'](str(machine(tmp_path, *files)))
    jax_named = f'jax=={installed[0]}' if jax_install is None else jax_install  # kept where it fits, pinned
    assert fake.pip == [['install', '-q', '-U', jax_named, TINY_LM]]
    out = capsys.readouterr().out
    assert out.startswith(f"Runtime: {device}. Installed JAX: {' on '.join(installed) if installed else 'none'}")
    if jax_install is None:
        assert fake.queries == 1 and f'Ready: JAX {installed[0]} (kept: new enough) sees the {device}.' in out
    else:  # the new JAX is asked again, in another process, what it sees
        assert fake.queries == 2 and f'Ready: JAX {NEW} (installed) sees the {device}.' in out
    assert 'RESTART' not in out


def test_a_new_jax_that_misses_the_accelerator_is_an_error(monkeypatch, tmp_path):
    fake = FakeSubprocess(('0.4.33', 'gpu'), after=(NEW, 'cpu'))
    cell = run_cell(monkeypatch, fake, colab=False)
    monkeypatch.delitem(sys.modules, 'jax', raising=False)
    with pytest.raises(RuntimeError, match='The new JAX sees cpu, not the gpu'):
        cell['set_up'](str(machine(tmp_path, *GPU)))


def test_replacing_a_jax_this_session_imported_asks_for_a_restart(monkeypatch, tmp_path, capsys):
    fake = FakeSubprocess(None, after=(NEW, 'tpu'))
    cell = run_cell(monkeypatch, fake, colab=False)
    monkeypatch.setitem(sys.modules, 'jax', fake_jax('0.4.38', 'tpu'))
    cell['set_up'](str(machine(tmp_path, *TPU_V5E)))  # no assert, no exception: a message
    assert fake.pip == [['install', '-q', '-U', 'jax[tpu]>=0.10', TINY_LM]]
    assert fake.queries == 0  # the session's own JAX was asked: it holds the TPU, another process would not get it
    out = capsys.readouterr().out
    assert 'Installed JAX: 0.4.38 on tpu.' in out
    assert 'RESTART NEEDED' in out and 'Runtime → Restart session' in out and 'Ready' not in out


def test_an_imported_jax_that_fits_is_kept_without_a_restart(monkeypatch, tmp_path, capsys):
    fake = FakeSubprocess(None)
    cell = run_cell(monkeypatch, fake, colab=False)
    monkeypatch.setitem(sys.modules, 'jax', fake_jax(NEW, 'tpu'))
    cell['set_up'](str(machine(tmp_path, *TPU_V5E)))
    assert fake.pip == [['install', '-q', '-U', f'jax=={NEW}', TINY_LM]] and fake.queries == 0
    out = capsys.readouterr().out
    assert 'RESTART' not in out and f'Ready: JAX {NEW} (kept: new enough) sees the tpu.' in out


def test_outside_colab_the_cell_does_nothing(monkeypatch, capsys):
    fake = FakeSubprocess((NEW, 'cpu'))
    cell = run_cell(monkeypatch, fake, colab=False)
    assert fake.pip == [] and fake.queries == 0 and capsys.readouterr().out == ''
    assert callable(cell['set_up'])


def test_on_colab_the_cell_sets_up_this_machine(monkeypatch, capsys):
    here = run_cell(monkeypatch, FakeSubprocess(None), colab=False)['runtime']()
    fake = FakeSubprocess(('0.4.33', here), after=(NEW, here))
    run_cell(monkeypatch, fake, colab=True)
    assert fake.pip == [['install', '-q', '-U', JAX_BUILDS[here], TINY_LM]]
    out = capsys.readouterr().out
    assert out.startswith(f'Runtime: {here}. Installed JAX: 0.4.33 on {here}.')
    assert f'Ready: JAX {NEW} (installed) sees the {here}.' in out


def _load_writer():
    spec = importlib.util.spec_from_file_location('colab_cell_write', WRITER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cell_is_short_flagged_and_pinned_like_settings_ini(tmp_path):
    lines = CELL.splitlines()
    assert lines[0] == '#| eval: false' and len(lines) <= 60
    writer = _load_writer()
    assert writer.pin_mismatches() == []
    settings = (ROOT / 'settings.ini').read_text(encoding='utf-8')
    for old, new, problem in [(' jax>=0.10 ', ' jax>=0.11 ', 'JAX_MIN = "0.11"'),
                              ('git_url = https://github.com/tiny-lm/tiny_lm', 'git_url = https://example.org/x',
                               'git_url = https://example.org/x')]:
        assert old in settings
        (tmp_path / 'settings.ini').write_text(settings.replace(old, new), encoding='utf-8')
        assert [p for p in writer.pin_mismatches(tmp_path / 'settings.ini') if problem in p]


def write(nbs: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WRITER), '--nbs', str(nbs), *flags], capture_output=True, text=True,
                          check=False)


def test_the_writer_fills_cells_1_2_and_check_catches_a_stale_notebook(tmp_path):
    nbs = tmp_path / 'nbs'
    nbs.mkdir()
    for name in ('01_model.ipynb', '09a_main.ipynb', 'index.ipynb'):
        shutil.copy(ROOT / 'nbs' / name, nbs / name)
    before = {p.name: json.loads(p.read_text(encoding='utf-8')) for p in nbs.iterdir()}
    assert write(nbs).returncode == 0
    assert write(nbs, '--check').returncode == 0
    assert (nbs / 'index.ipynb').read_text(encoding='utf-8') == (ROOT / 'nbs' / 'index.ipynb').read_text('utf-8')
    for name in ('01_model.ipynb', '09a_main.ipynb'):
        old, new = before[name]['cells'], json.loads((nbs / name).read_text(encoding='utf-8'))['cells']
        assert [c['id'] for c in new] == [c['id'] for c in old]
        assert new[:1] + new[3:] == old[:1] + old[3:]  # nothing else changes
        assert ''.join(new[2]['source']) == CELL.rstrip('\n') and new[2]['outputs'] == []
        assert ''.join(new[1]['source']) == (ROOT / '.ci' / 'colab_cell.md').read_text('utf-8').rstrip('\n')

    nb = json.loads((nbs / '09a_main.ipynb').read_text(encoding='utf-8'))
    nb['cells'][2]['source'][-1] += '\nprint("an edit by hand")'
    (nbs / '09a_main.ipynb').write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n', encoding='utf-8')
    stale = write(nbs, '--check')
    assert stale.returncode == 1 and 'nbs/09a_main.ipynb' in stale.stderr and '01_model' not in stale.stderr
    assert write(nbs).returncode == 0 and write(nbs, '--check').returncode == 0


def test_the_writer_refuses_a_notebook_without_the_colab_cells(tmp_path):
    nbs = tmp_path / 'nbs'
    nbs.mkdir()
    nb = json.loads((ROOT / 'nbs' / '09a_main.ipynb').read_text(encoding='utf-8'))
    del nb['cells'][1:3]
    (nbs / '09a_main.ipynb').write_text(json.dumps(nb, indent=1) + '\n', encoding='utf-8')
    result = write(nbs, '--check')
    assert result.returncode != 0 and '09a_main.ipynb: cells 1-2 are not the Colab cells' in result.stderr
