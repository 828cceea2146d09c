"""``python -m kvrouter.api.cli``: the ``kvrouter`` command."""

from kvrouter.api.cli.main import main

raise SystemExit(main())
