"""``python -m rwkvx``: see :mod:`rwkvx.cli`."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
