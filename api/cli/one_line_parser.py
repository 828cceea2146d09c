"""An argparse parser whose usage errors are one line (and exit 2), as every kvrouter failure is."""

from __future__ import annotations

import argparse
import difflib
from typing import Any

from kvrouter.api.process.exit_reasons import BAD_CONFIGURATION

UNRECOGNIZED = "unrecognized arguments: "


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line naming the problem and ``--help`` (exit 2), not argparse's usage block; an unknown
    flag also names the nearest valid one (a typo, or a flag spelled as another program spells it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No prefixes: ``--router-mod`` is a typo to name, not ``--router-mode`` to guess (nor ``--http`` either
        # of ``--http-host`` and ``--http-port``).
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(BAD_CONFIGURATION, f"{self.prog}: {message}{self.suggestion(message)} (see --help)\n")

    def suggestion(self, message: str) -> str:
        """``; did you mean --x?`` for the first unknown flag in ``message`` that is close to a valid one."""
        if not message.startswith(UNRECOGNIZED):
            return ""
        # argparse keeps its flags in a private table; it has been there since argparse began, and a missing one
        # only loses the suggestion.
        known = list(getattr(self, "_option_string_actions", {}))
        for word in message.removeprefix(UNRECOGNIZED).split():
            if word.startswith("--"):
                close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.7)
                if close:
                    return f"; did you mean {close[0]}?"
        return ""
