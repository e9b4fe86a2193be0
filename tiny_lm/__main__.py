

# %% ../nbs/09_cli.ipynb #840dc040
import sys

from tiny_lm.cli import main

if __name__ == "__main__":
    sys.exit(main())

# %% ../nbs/09_cli.ipynb #840dc040
import sys

from tiny_lm.cli import main

if __name__ == "__main__":
    sys.exit(main())