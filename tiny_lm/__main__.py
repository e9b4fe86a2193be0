

# %% ../nbs/09_cli.ipynb #dab8780b
#| eval: false
import sys

from tiny_lm.cli import main

if __name__ == "__main__":
    sys.exit(main())

# %% ../nbs/09_cli.ipynb #dab8780b
#| eval: false
import sys

from tiny_lm.cli import main

if __name__ == "__main__":
    sys.exit(main())

# %% ../nbs/09_cli.ipynb #cdd1f288
#| eval: false
import sys

from tiny_lm.cli import main

if __name__ == "__main__":
    sys.exit(main())