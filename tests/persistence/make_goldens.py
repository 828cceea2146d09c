"""Write the golden files the current format version lacks; never rewrite an existing one.

    .venv/bin/python tests/persistence/make_goldens.py

Run it after bumping ``RECORD_VERSION`` or ``SNAPSHOT_VERSION`` (with the upcasters that read the
previous version), then commit the new files. A golden file that no longer matches is a format change:
bump the version instead of deleting the file, so the old bytes keep proving they still decode.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden_samples import SAMPLES, SCOPE, SNAPSHOT_LSN, record_path, sample_states, snapshot_path

from kvrouter.actors.persistence.codec import RECORD_VERSION, encode_record
from kvrouter.actors.persistence.snapshots import SNAPSHOT_VERSION, encode_snapshot


def main() -> int:
    wanted = {record_path(tag, RECORD_VERSION): encode_record(SCOPE, (event,)) for tag, event in SAMPLES.items()}
    scopes = [state.to_snapshot() for state in sample_states()]
    wanted[snapshot_path(SNAPSHOT_VERSION)] = encode_snapshot(SNAPSHOT_LSN, scopes)
    for path, data in sorted(wanted.items()):
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            print(f"wrote {path.name}")
        elif path.read_bytes() != data:
            print(f"{path.name} differs from today's encoding: bump the format version instead", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
