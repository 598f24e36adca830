"""``python -m graphmod``: the ``graphmod`` command, for an environment whose scripts
directory is not on the ``PATH`` (a notebook's kernel, ``python -m venv`` not activated).

Run ``python -m graphmod --help`` for the commands (:mod:`graphmod._cli`).
"""

import sys

from graphmod._cli import main

if __name__ == "__main__":
    sys.exit(main())
