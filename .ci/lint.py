"""ruff on the exported package: pyflakes (F), lines of at most 120 characters (E501), and functions short and simple
enough to read (C901 complexity, PLR0915 statements; limits in pyproject.toml).

    python .ci/lint.py

Two checks of the package's shape as well: every module's notebook comes after the notebooks of the modules it
imports (a type-only or a late import too), so the course never reads backwards; and no module is longer than
`MAX_LINES`: past that, a module holds more than one concern (issue 54).

`__all__` is left out of the length check: nbdev writes it, wrapped at 120 characters after its 10-character prefix
`__all__ = `, so its first line may be longer. Every other line counts, the notebooks' exported code included.
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES = "F,E501,C901,PLR0915"
MAX_LINES = 600


def without_all(text: str) -> str:
    "`text` with nbdev's `__all__ = [...]` lines blanked (line numbers unchanged)."
    return re.sub(r"^__all__ = \[.*?\]$", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)


def notebook_of(path: Path) -> str | None:
    "The notebook that exports `path` (its stem, e.g. '04c_train'), from nbdev's header."
    m = re.search(r"File to edit: \.\./nbs/(\S+)\.ipynb", path.read_text())
    return m and m.group(1)


def shape_problems(paths: list[Path]) -> list[str]:
    "Modules imported from a later notebook, and modules longer than they may be."
    notebooks = {p.stem: notebook_of(p) for p in paths}
    problems = []
    for p in paths:
        text, nb = p.read_text(), notebooks[p.stem]
        for name in sorted(set(re.findall(r"^\s*from (?:\.|tiny_lm\.)(\w+) import", text, flags=re.M))):
            if nb and notebooks.get(name) and notebooks[name] > nb:
                problems.append(f"{p.name} ({nb}) imports {name} from a later notebook, {notebooks[name]}")
        if (lines := text.count("\n")) > MAX_LINES:
            problems.append(f"{p.name} has {lines} lines, more than {MAX_LINES}: split it where its concerns are")
    return problems


def main() -> int:
    paths = [p for p in sorted((ROOT / "tiny_lm").glob("*.py")) if p.name not in ("_modidx.py", "__init__.py")]
    problems = shape_problems(paths)
    print(*problems, sep="\n") if problems else None
    status = int(bool(problems))
    for path in sorted((ROOT / "tiny_lm").glob("*.py")):
        if path.name == "_modidx.py":  # nbdev's index of names, not code
            continue
        relative = str(path.relative_to(ROOT))
        r = subprocess.run(["ruff", "check", "--quiet", "--select", RULES, "--stdin-filename", relative, "-"],
                           input=without_all(path.read_text()), text=True, cwd=ROOT)
        status |= r.returncode
    if status == 0:
        print(f"ok: ruff {RULES} on tiny_lm/ (line length, complexity and statement limits in pyproject.toml); "
              f"imports in the notebooks' order; modules of at most {MAX_LINES} lines")
    return status


if __name__ == "__main__":
    sys.exit(main())
