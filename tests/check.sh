#!/usr/bin/env bash
# Every check tiny_lm's CI runs, in order: export/clean/README are up to date, ruff (.ci/lint.py), the notebooks
# (.ci/notebooks.py: no `../`, then copies outside the repository against the built wheel), then pytest. pytest
# runs last so that its summary ("N passed in ...") is the final line printed. Run from the repository root with
# the dev virtual environment active:
#   pip install --no-compile -e ".[dev]" && bash tests/check.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -z "${VIRTUAL_ENV:-}" && -x .venv/bin/python ]]; then
    export PATH="$PWD/.venv/bin:$PATH"  # the repo's own venv, when it is not activated
fi
for tool in nbdev_export nbdev_clean ruff python; do
    command -v "$tool" >/dev/null || { echo "check: '$tool' not found; run: pip install -e \".[dev]\"" >&2; exit 1; }
done

# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): the install skips compiling
# the 2 GB environment (pip --no-compile), and the hundreds of test processes import the same few libraries, so each
# module is compiled once, on its first import, instead of in every process.
unset PYTHONDONTWRITEBYTECODE

header() { printf '\n== check %s ==\n' "$1"; }

# Every program the checks compile is compiled for speed of compiling: LLVM's optimisations off, and XLA:CPU's older
# element-wise code generators instead of its fusion emitters (MLIR). Most of the checks' CPU time is XLA compiling
# tiny models: a 2-layer model's training step compiles in 0.55 CPU-s with both, 2.0 s with the first alone and 3.6 s
# with neither (2026-11-29); 04c_train runs in 79 s instead of 106 s. The programs compute the same things (XLA's own
# rewrites and the library products do not depend on them), their float sums in another order at most (a 30-step run's
# losses within 1.9e-6 of XLA's default with both flags, as with the first alone, 2026-11-29), but their element-wise
# loops run slower (decoding ~10x). So what users run compiles with XLA's default, and so do the checks of speed and
# of profiles (test_cli's AS_USERS) and the float-order test's second worker (tests/test_float_order.py).
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# A device of a split CPU that waits longer than XLA's 40 s for the others at a collective ends the process (abort,
# signal 6). Three test workers on two cores slowed one that far once (CI, 2026-11-30: the budget test's 2-device run,
# "waiting for all reduce ... only 1 of them arrived"); a wait of 120 s is allowed, so that only a wait that does not
# end (a real deadlock) still fails. It changes nothing computed.
export XLA_FLAGS="$XLA_FLAGS --xla_cpu_collective_call_terminate_timeout_seconds=120"

# One JAX persistent compilation cache for the whole run, new each run: a program compiled by one notebook or test
# (same model, same devices, same flags) is loaded by every later one instead of compiled again. Every program is
# kept (no minimum compile time or size): on 2 cores most of a tiny model's test time is compiling it.
cache_dir="$(mktemp -d "${TMPDIR:-/tmp}/tiny_lm_ci_jax_cache.XXXXXX")"
export JAX_COMPILATION_CACHE_DIR="$cache_dir" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
# The checks write only where they own the folder: the figures tiny_lm measures once and keeps (the CPU's speed that
# plans size by, 02_sizing's `cache_file`) and Hugging Face's caches go to this run's own folder, not the user's
# ~/.cache. A CPU timed while the checks load it is several times slower than it is, and every later plan on the
# machine would size its models by that figure (tests/conftest.py does the same for pytest run by itself).
own_cache="$(mktemp -d "${TMPDIR:-/tmp}/tiny_lm_ci_cache.XXXXXX")"
export XDG_CACHE_HOME="$own_cache/cache" HF_HOME="$own_cache/huggingface" TINY_LM_TESTS_OWN_CACHE="$own_cache"

# Hash of every file under nbs/ and tiny_lm/, so we see exactly what export/clean changed
# (works on a fresh clone and on a working tree with uncommitted notebooks alike).
snapshot() {
    find nbs tiny_lm -type f -not -path '*/__pycache__/*' -not -path '*/.ipynb_checkpoints/*' -print0 |
        LC_ALL=C sort -z | xargs -0 sha256sum
}

header "1/4: notebooks exported and clean, README and Colab cells generated"
before="$(snapshot)"
nbdev_export
nbdev_clean
after="$(snapshot)"
if [[ "$before" != "$after" ]]; then
    echo "check: nbdev_export/nbdev_clean changed these files; run them and commit the result:" >&2
    { diff <(echo "$before") <(echo "$after") || true; } | sed -n 's/^[<>] [0-9a-f]*  /  /p' | sort -u >&2
    exit 1
fi
readme_before="$(mktemp)"
trap 'rm -rf "$readme_before" "$cache_dir" "$own_cache"' EXIT
cp README.md "$readme_before" 2>/dev/null || true
python .ci/readme.py
if ! cmp -s README.md "$readme_before"; then
    echo "check: README.md was out of date with nbs/index.ipynb; run 'python .ci/readme.py' and commit README.md" >&2
    exit 1
fi
# every notebook's Colab set-up cells are .ci/colab_cell.md and .ci/colab_cell.py
python .ci/colab_cell_write.py --check
echo "ok: nothing to export, clean or regenerate"

header "2/4: ruff on tiny_lm: pyflakes, 120-character lines, function complexity and length (.ci/lint.py)"
python .ci/lint.py

header "3/4: notebooks as readers open them: copies outside the repo, the built wheel (skips slow, net, accel)"
# Three notebooks at once on two cores: a notebook waits at times (compiling on one thread, a `tiny-lm` subprocess
# starting), and a third keeps the cores busy then: 398 s against 440 s with two (197 % of a core busy with three;
# a fresh JAX cache each, 2026-11-29).
XLA_FLAGS="$XLA_FLAGS --xla_force_host_platform_device_count=8" HF_HUB_OFFLINE=1 TQDM_DISABLE=1 \
    python .ci/notebooks.py --workers 3

header "4/4: pytest tests (export, ruff and the notebooks passed)"
# The compilers of `tiny-lm compile` (libtpu, XLA's GPU compiler, cuDNN) for tests/test_compile.py, in a folder of
# their own (pip --target, on those tests' PYTHONPATH alone): with libtpu installed, every JAX program on the machine
# first looks for a TPU and prints errors where there is none. Pinned by the installed JAX's own extras; installed
# once (2.3 GB), again when the pins change. Where they cannot be installed, those tests say so and are skipped.
compilers="${VIRTUAL_ENV:-$PWD/.venv}/tiny_lm_compilers"
pins="$(python -c "from tiny_lm.compile import compiler_requirements as r; print(' '.join(r('tpu') + r('gpu')))")"
if [[ "$(cat "$compilers/.pins" 2>/dev/null)" != "$pins" ]]; then
    rm -rf "$compilers"
    # shellcheck disable=SC2086  # the pins are words
    if pip install --quiet --no-compile --no-deps --target "$compilers" $pins; then
        echo "$pins" > "$compilers/.pins"
    else
        echo "check: the compilers ($pins) could not be installed: tests/test_compile.py skips its compiles" >&2
    fi
fi
export TINY_LM_COMPILERS="$compilers"
status=0
# three workers on two cores: some tests wait (a copy's back-off, a time budget's clock, a second process starting),
# and the third keeps the cores busy then: 313 s against 415 s with two (195 % of a core busy against 182 %,
# 2026-11-29)
HF_HUB_OFFLINE=1 python -m pytest -q -n 3 --dist worksteal --durations=15 tests || status=$?
if [[ $status -eq 5 ]]; then
    echo "check: pytest collected no tests: tests/ must hold tests" >&2
    exit 1
fi
exit "$status"
