"""``python -m megatron_tree.eval``: the eval's command line (see :mod:`megatron_tree.eval`)."""

import sys

from .launch import main

if __name__ == "__main__":
    sys.exit(main())
