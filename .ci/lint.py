"""ruff on the exported package: pyflakes (F), lines of at most 120 characters (E501), and functions short and simple
enough to read (C901 complexity, PLR0915 statements; limits in pyproject.toml).

    python .ci/lint.py

`__all__` is left out of the length check: nbdev writes it, wrapped at 120 characters after its 10-character prefix
`__all__ = `, so its first line may be longer. Every other line counts, the notebooks' exported code included.
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES = "F,E501,C901,PLR0915"


def without_all(text: str) -> str:
    "`text` with nbdev's `__all__ = [...]` lines blanked (line numbers unchanged)."
    return re.sub(r"^__all__ = \[.*?\]$", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)


def main() -> int:
    status = 0
    for path in sorted((ROOT / "tiny_lm").glob("*.py")):
        if path.name == "_modidx.py":  # nbdev's index of names, not code
            continue
        relative = str(path.relative_to(ROOT))
        r = subprocess.run(["ruff", "check", "--quiet", "--select", RULES, "--stdin-filename", relative, "-"],
                           input=without_all(path.read_text()), text=True, cwd=ROOT)
        status |= r.returncode
    if status == 0:
        print(f"ok: ruff {RULES} on tiny_lm/ (line length, complexity and statement limits in pyproject.toml)")
    return status


if __name__ == "__main__":
    sys.exit(main())
