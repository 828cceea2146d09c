"""A ``--discovery-file``: a JSON or YAML list of worker records (the fields of ``POST /workers``), read whole."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import orjson

from kvrouter.actors.core.catalog import WorkerRecord

MAX_FILE_BYTES: Final = 16 * 1024 * 1024

# Reads the file's entries (``POST /workers`` bodies) as records; raises ValueError naming the bad entry.
FileParser = Callable[[list[Any]], list[WorkerRecord]]


def read_worker_file(path: Path, parse: FileParser) -> list[WorkerRecord]:
    """The file's workers: a JSON or YAML list of ``POST /workers`` bodies (or ``{"workers": [...]}``). Raises
    ValueError (or OSError) with a reason a person can act on."""
    raw = path.read_bytes()
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"{path} is {len(raw)} bytes, over {MAX_FILE_BYTES}")
    document: Any
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml  # only a YAML file needs it

        try:
            document = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not YAML: {_one_line(exc)}") from None
    else:
        try:
            document = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
    if isinstance(document, dict) and "workers" in document:
        document = document["workers"]
    if document is None:
        document = []
    if not isinstance(document, list):
        raise ValueError(f"{path}: expected a list of workers (or {{'workers': [...]}})")
    records = parse(document)
    ids = [record.worker_id for record in records]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: a worker_id is listed twice")
    return records


def _one_line(exc: Exception) -> str:
    """PyYAML's error on one line: its problem and where (``line L, column C``), not the quoted source it draws."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"
