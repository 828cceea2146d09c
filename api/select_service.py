"""``python -m api.select_service`` mirrors the reference's ``python -m dynamo.select_service``.

Only the entry point: the service is composed in ``api/process/main.py`` (``select_service_builder``), so the
command line (``api/cli/main.py``) and this module do not import each other in a circle.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from kvrouter.api.cli.main import main

    sys.exit(main(["select-service", *sys.argv[1:]]))
