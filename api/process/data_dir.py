"""Which service a data directory belongs to: a small marker file, written on first use.

The two services share one journal format, so either could read the other's journal and serve it as its
own state (a slot tracker would come up with a selection service's reservations). The marker names the
owner; another service refuses the directory in one line (exit 2) before it opens the journal.

A directory from before markers (a journal, no marker) is adopted by the first service that opens it,
unless its recovered state says otherwise: selection partitions (catalog records, indexed blocks, a
partition block size) mean the selection service, slot-tracker registrations without any of those mean
the slot tracker. That costs nothing, since recovery runs anyway, and catches the mix-up the marker exists
to prevent. An empty directory, or one whose state says nothing, goes to whoever opens it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import orjson

from kvrouter.actors.core.state import ScopeState

MARKER = "kvrouter-service.json"
SLOT_TRACKER = "slot tracker"
SELECTION_SERVICE = "selection service"


class DataDirectoryOwned(Exception):
    """The data directory belongs to another service (or its marker cannot be read); one line."""


def owner(data_dir: Path) -> str | None:
    """The service recorded in ``data_dir``'s marker; None when there is no marker."""
    path = data_dir / MARKER
    try:
        document = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, orjson.JSONDecodeError) as exc:
        raise DataDirectoryOwned(
            f"the owner marker {path} cannot be read ({getattr(exc, 'strerror', None) or exc}); "
            f"it names the service this directory belongs to: fix it or delete it"
        ) from None
    service = document.get("service") if isinstance(document, dict) else None
    if not isinstance(service, str) or not service:
        raise DataDirectoryOwned(f"the owner marker {path} names no service; fix it or delete it")
    return service


def check_owner(data_dir: Path, service: str) -> None:
    """Refuse ``data_dir`` if its marker names another service. Call before opening the journal."""
    recorded = owner(data_dir)
    if recorded is not None and recorded != service:
        raise DataDirectoryOwned(_refusal(data_dir, service, f"belongs to the {recorded} (see {data_dir / MARKER})"))


def journal_owner(states: Iterable[ScopeState]) -> str | None:
    """The service a recovered state must come from, when it tells (see the module doc)."""
    slot_tracker = False
    for state in states:
        if state.selection.exists:
            return SELECTION_SERVICE
        slot_tracker = slot_tracker or bool(state.slots.workers)
    return SLOT_TRACKER if slot_tracker else None


def claim(data_dir: Path, service: str, recovered: Iterable[ScopeState]) -> None:
    """Record ``service`` as the owner of ``data_dir`` (after recovery), unless already recorded.

    A directory without a marker whose recovered state belongs to the other service is refused.
    """
    if owner(data_dir) is not None:
        return  # check_owner has accepted it
    found = journal_owner(recovered)
    if found is not None and found != service:
        raise DataDirectoryOwned(_refusal(data_dir, service, f"holds a {found}'s journal"))
    _write_marker(data_dir, service)


def _refusal(data_dir: Path, service: str, why: str) -> str:
    return f"the data directory {data_dir} {why}; give this {service} its own --data-dir"


def _write_marker(data_dir: Path, service: str) -> None:
    """Atomically: a temporary file, fsynced, renamed into place, and the directory fsynced."""
    final = data_dir / MARKER
    temporary = data_dir / (MARKER + ".tmp")
    with open(temporary, "wb") as file:
        file.write(orjson.dumps({"service": service, "format": 1}) + b"\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, final)
    directory = os.open(data_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
