"""An argparse parser whose usage errors are one line (and exit 2), as every kvrouter failure is."""

from __future__ import annotations

import argparse

from kvrouter.api.process.exit_reasons import BAD_CONFIGURATION


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line naming the problem and ``--help`` (exit 2), not argparse's usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(BAD_CONFIGURATION, f"{self.prog}: {message} (see --help)\n")
