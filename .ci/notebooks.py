"""Test the notebooks the way a reader opens them: a copy outside the repository, against the built wheel.

    python .ci/notebooks.py                        # every notebook nbdev_test would run
    python .ci/notebooks.py nbs/01_model.ipynb     # some notebooks
    python .ci/notebooks.py --static-only          # only the `../` check (no build)
    python .ci/notebooks.py --wheel dist/x.whl     # test this wheel instead of building one

1. A static check over every code cell of every notebook: a notebook that reaches for `../anything` (the tests'
   fixtures, a shared folder) works in the repository and breaks on Colab, where the notebook is alone. It fails
   with one line per offence: the notebook, the cell (counted from 1, as nbdev's tracebacks count) and the path.
2. The wheel is built from a copy of the package sources (offline, with the installed setuptools: `build
   --no-isolation`) and must hold every file of `tiny_lm/`, the lesson texts `tiny_lm/texts/*` included.
3. The wheel is installed with `pip install --no-deps --target TMP/site`; each notebook is copied, alone, into a
   temporary folder and run there by nbdev's own runner (`nbdev.test.test_nb`, skipping the cells nbdev_test skips:
   settings.ini `tst_flags` and `#| eval: false`), in worker processes whose `PYTHONPATH` is TMP/site and whose
   `PATH` starts with TMP/bin, where a `tiny-lm` launcher runs the wheel's code. So `import tiny_lm` and the
   `tiny-lm` command are the wheel's, never the repository's, and `../` finds nothing.
"""
import argparse
import configparser
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# `../x` (not the tail of an ellipsis `.../`) or a bare '..' / ".." string
_PARENT = re.compile(r"""(?<!\.)\.\./[^\s'"`),;]*|(?<=['"])\.\.(?=['"])""")


def _source(cell: dict) -> str:
    src = cell.get('source', '')
    return ''.join(src) if isinstance(src, list) else src


def _shown(path: Path) -> str:
    path = Path(path).absolute()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def parent_refs(notebook: Path) -> list[str]:
    """One line per `../` path a code cell of `notebook` reaches for, outside its folder (comment lines ignored)."""
    cells = json.loads(Path(notebook).read_text(encoding='utf-8')).get('cells', [])
    found = []
    for idx, cell in enumerate(cells, start=1):  # execnb's numbering
        if cell.get('cell_type') != 'code':
            continue
        code = '\n'.join(ln for ln in _source(cell).splitlines() if not ln.lstrip().startswith('#'))
        for path in dict.fromkeys(m.group(0) for m in _PARENT.finditer(code)):
            found.append(f"{_shown(notebook)}, cell #{idx}: reaches outside the notebook's folder for {path!r}")
    return found


def static_check(notebooks: list[Path]) -> list[str]:
    """Every `../` offence in `notebooks`: cheap, before anything is built."""
    return [line for nb in notebooks for line in parent_refs(nb)]


def default_notebooks() -> list[Path]:
    """The notebooks nbdev_test would run: nbdev's glob of nbs/, less folders holding a `.notest` file."""
    from nbdev.doclinks import nbglob
    with contextlib.chdir(ROOT):
        files = nbglob(as_path=True)
    return [f.absolute() for f in sorted(files) if not (f.parent / '.notest').exists()]


def skip_flags() -> list[str]:
    """settings.ini's `tst_flags`: the cell flags nbdev_test skips."""
    config = configparser.ConfigParser(delimiters=['='])
    config.read(ROOT / 'settings.ini', encoding='utf-8')
    return config['DEFAULT'].get('tst_flags', '').split()


def build_wheel(out_dir: Path) -> Path:
    """Build tiny_lm's wheel into `out_dir` from a copy of the sources (a stale build/ in the repo cannot leak in)."""
    src = Path(tempfile.mkdtemp(prefix='tiny_lm_src_'))
    try:
        for p in ROOT.iterdir():
            if p.is_file() and not p.name.startswith('.'):
                shutil.copy2(p, src / p.name)
        shutil.copytree(ROOT / 'tiny_lm', src / 'tiny_lm', ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
        r = subprocess.run([sys.executable, '-m', 'build', '--wheel', '--no-isolation', '--outdir', str(out_dir),
                            str(src)], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"notebooks: building the wheel failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    finally:
        shutil.rmtree(src, ignore_errors=True)
    return next(Path(out_dir).glob('tiny_lm-*.whl'))


def missing_from_wheel(wheel: Path) -> list[str]:
    """The files of the repository's `tiny_lm/` (lesson texts included) that `wheel` lacks."""
    names = set(zipfile.ZipFile(wheel).namelist())
    pkg = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / 'tiny_lm').rglob('*'))
           if p.is_file() and '__pycache__' not in p.parts and p.suffix != '.pyc']
    return [p for p in pkg if p not in names]


def install_wheel(wheel: Path, tmp: Path) -> tuple[Path, Path]:
    """Install `wheel` (no dependencies: the venv has them) into tmp/site; a launcher per console script in tmp/bin."""
    site, bin_dir = tmp / 'site', tmp / 'bin'
    r = subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-deps', '--no-compile',
                        '--disable-pip-version-check', '--target', str(site), str(wheel)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise SystemExit(f"notebooks: installing {wheel.name} failed:\n{r.stdout}{r.stderr}")
    bin_dir.mkdir()
    config = configparser.ConfigParser(delimiters=['='])
    config.read(next(site.glob('tiny_lm-*.dist-info')) / 'entry_points.txt', encoding='utf-8')
    for name, target in (config['console_scripts'].items() if config.has_section('console_scripts') else []):
        module, func = target.split(':')
        launcher = bin_dir / name
        launcher.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(site)!r})\n"
                            f"from {module} import {func}\nsys.exit({func}())\n")
        launcher.chmod(0o755)
    return site, bin_dir


def copy_notebooks(notebooks: list[Path], dest: Path) -> list[Path]:
    """Copies of `notebooks`, and nothing else, under `dest` (nbs/ subfolders kept)."""
    copies = []
    for nb in notebooks:
        nb = Path(nb).absolute()
        rel = nb.relative_to(ROOT / 'nbs') if nb.is_relative_to(ROOT / 'nbs') else Path(nb.name)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        copies.append(Path(shutil.copy2(nb, dest / rel)))
    return copies


# Seconds each notebook took on 2 cores (last measured): the longest start first, so that no worker is left alone
# with a long notebook at the end (longest-processing-time-first scheduling). A notebook not listed counts as 30 s.
SECONDS = {'04c_train': 110, '09_cli': 110, '05_parallel': 85, '01_model': 65, '07_generate': 60, '14_scale_out': 60,
           '02_sizing': 55, '13_size_sweep': 50, '06_checkpoint': 45, '08b_bench': 45, '10a_shakespeare': 35,
           '03b_loss': 25,  # an estimate: the loss's cells of 04c_train, moved
           '07b_show': 17, '07a_score': 15, '00_errors': 2}  # the last three: estimates (measured under load x 0.45)


def longest_first(copies: list[Path]) -> list[Path]:
    """`copies` in the order to start them: the longest expected first."""
    return sorted(copies, key=lambda p: -SECONDS.get(p.stem, 30))


def _test_one(fn: str, flags: list[str]) -> tuple[str, bool, float, str]:
    """Run one notebook copy with nbdev's runner (in a worker process); its traceback is returned, not printed."""
    import io
    from nbdev.test import test_nb
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        ok, secs = test_nb(Path(fn), skip_flags=flags)
    return fn, ok, secs, err.getvalue()


def _summary(tb: str) -> str:
    """`cell #N: Error: message` from execnb's pretty traceback."""
    cell = re.search(r'While Executing Cell #(\d+)', tb)
    last = [ln for ln in tb.strip().splitlines() if ln.strip() and not ln.startswith('=')]
    where = f"cell #{cell.group(1)}: " if cell else ''
    return where + (last[-1].strip() if last else 'failed')


def _run_copies(args) -> int:
    """The worker side (PYTHONPATH is the wheel's site only): run the copies in `args.workers` processes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    flags, copies = args.flags.split(), [Path(p) for p in args.run_copies]
    # a notebook's IPython shell replaces sys.modules['__main__'] in the worker: name this module apart, so that
    # the worker still finds _test_one for the next notebook (nbdev_test's test_nb lives in an importable module)
    sys.modules['_outside_runner'] = sys.modules[__name__]
    _test_one.__module__ = '_outside_runner'
    start, failed = time.time(), []
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=multiprocessing.get_context('fork')) as pool:
        futures = {}
        for fn in longest_first(copies):
            futures[pool.submit(_test_one, str(fn), flags)] = str(fn)
            time.sleep(0.01)  # as nbdev_test's pause
        for fut in as_completed(futures):
            try:
                fn, ok, secs, tb = fut.result()
            except Exception as e:  # the worker died (a crash in native code, os._exit): the pool is gone too
                fn, ok, secs, tb = futures[fut], False, 0.0, f"the worker process running it died: {e!r}"
            name = Path(fn).relative_to(Path.cwd())
            print(f"{'ok  ' if ok else 'FAIL'} {secs:6.1f}s  {name}", flush=True)
            if not ok:
                failed.append((name, tb))
    print(f"{len(copies) - len(failed)} of {len(copies)} notebooks passed outside the repository in "
          f"{time.time() - start:.0f}s ({args.workers} workers)")
    for name, tb in failed:
        sys.stderr.write(f"\n{tb.rstrip()}\n")
    for name, tb in failed:
        sys.stderr.write(f"notebooks: {name} failed outside the repository: {_summary(tb)}\n")
    return 1 if failed else 0


def run_outside(notebooks: list[Path], wheel: Path, tmp: Path, workers: int = 2) -> int:
    """Install `wheel`, copy `notebooks` into a folder of their own and run them there; the exit status."""
    site, bin_dir = install_wheel(wheel, tmp)
    nbs_dir = tmp / 'nbs'
    copies = copy_notebooks(notebooks, nbs_dir)
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    env.update(PYTHONPATH=str(site), PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
    cmd = [sys.executable, __file__, '--workers', str(workers), '--flags', ' '.join(skip_flags()),
           '--run-copies', *map(str, copies)]
    return subprocess.run(cmd, cwd=nbs_dir, env=env).returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('notebooks', nargs='*', type=Path, help='notebooks to test (default: those nbdev_test runs)')
    p.add_argument('--workers', type=int, default=2, help='notebooks run at once (nbdev_test --n_workers)')
    p.add_argument('--static-only', action='store_true', help='only the `../` check')
    p.add_argument('--wheel', type=Path, help='test this wheel instead of building one')
    p.add_argument('--flags', default='', help=argparse.SUPPRESS)
    p.add_argument('--run-copies', nargs='+', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_copies:
        return _run_copies(args)
    notebooks = args.notebooks or default_notebooks()
    offences = static_check(notebooks)
    for line in offences:
        print(f"notebooks: {line}", file=sys.stderr)
    if offences:
        print(f"notebooks: {len({o.split(', cell #')[0] for o in offences})} notebooks reach outside their folder, "
              f"which a reader on Colab does not have: use tiny_lm.data.lesson_text() for a lesson text, or write "
              f"the file into a tempfile.mkdtemp() folder", file=sys.stderr)
        return 1
    print(f"ok: no notebook of {len(notebooks)} reaches outside its folder (../)")
    if args.static_only:
        return 0
    with tempfile.TemporaryDirectory(prefix='tiny_lm_outside_') as tmp:
        tmp, t0 = Path(tmp), time.time()
        wheel = args.wheel.absolute() if args.wheel else build_wheel(tmp / 'dist')
        missing = missing_from_wheel(wheel)
        if missing:
            print(f"notebooks: {wheel.name} lacks {', '.join(missing)} (package data: setup.py package_data, "
                  f"MANIFEST.in)", file=sys.stderr)
            return 1
        print(f"ok: {wheel.name} holds every file of tiny_lm/ ({'built' if not args.wheel else 'given'}, "
              f"{time.time() - t0:.1f}s)", flush=True)
        return run_outside(notebooks, wheel, tmp, args.workers)


if __name__ == '__main__':
    if '--run-copies' in sys.argv and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # the worker side imports nothing from the repository, .ci/ included
    sys.exit(main())
