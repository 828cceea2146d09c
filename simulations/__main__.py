"""``python -m kvrouter.simulations ...``: the same as ``kvrouter simulate ...`` (see ``cli.py``)."""

from __future__ import annotations

import sys

from kvrouter.simulations.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m kvrouter.simulations"))
