"""``python -m api.slot_tracker`` mirrors the reference's ``python -m dynamo.slot_tracker``."""

from __future__ import annotations

import sys

from kvrouter.api.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["slot-tracker", *sys.argv[1:]]))
