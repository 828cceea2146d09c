"""``kvrouter journal``: look at a stopped service's journal, and cut it after an lsn (the repair path).

Recovery refuses to start on a record it cannot use and names its lsn in one line, with the command
that repairs it:

    kvrouter journal inspect --data-dir D                       # records, snapshots, where recovery stops
    kvrouter journal truncate-after --data-dir D --lsn N        # what the cut would remove (dry run)
    kvrouter journal truncate-after --data-dir D --lsn N --yes  # cut: records after N are gone for good

Exit status: 0 done (inspect: recovery would start), 1 inspect found that recovery would stop, 2 the
command was refused (bad arguments, directory missing or in use, a cut that would not recover).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from kvrouter.actors.core.ids import U64_MASK
from kvrouter.actors.core.router_config import parse_int
from kvrouter.actors.persistence.journal_check import RecoveryCheck, Stop, check_recovery, describe_record
from kvrouter.api.main import lock_data_dir
from kvrouter.journal.frames import MAX_PAYLOAD_BYTES
from kvrouter.journal.repair import (
    CannotTruncate,
    DamagedFrame,
    Truncation,
    inspect_records,
    inspect_snapshots,
    plan_truncation,
    truncate_after,
)
from kvrouter.journal.store import DataDirectoryInUse

DONE = 0
WOULD_NOT_RECOVER = 1
REFUSED = 2


class Refusal(Exception):
    """The one line a refused command prints (exit 2)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrouter journal",
        description="Inspect or repair the journal of a stopped kvrouter service.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{inspect,truncate-after}")
    inspect = commands.add_parser(
        "inspect",
        help="list records and snapshots, and where recovery would stop (changes nothing)",
        description="List every record (lsn, size, place, scope and events) and snapshot, check them, and "
        "replay the log as recovery would, without changing a byte. Exit 1 if recovery would stop.",
    )
    inspect.add_argument("--data-dir", metavar="DIR", required=True, help="the service's --data-dir")
    truncate = commands.add_parser(
        "truncate-after",
        help="drop every record after an lsn (dry run unless --yes)",
        description="Drop every record after --lsn, and every snapshot that includes one, so that the service "
        "starts without them. Refused (exit 2, nothing changed) if the log that would be left does not recover. "
        "The service must be stopped.",
    )
    truncate.add_argument("--data-dir", metavar="DIR", required=True, help="the service's --data-dir")
    truncate.add_argument("--lsn", metavar="N", required=True, help="the last record to keep")
    truncate.add_argument("--yes", action="store_true", help="really truncate (without it: show what would go)")
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    args = build_parser().parse_args(argv)
    try:
        directory = _existing_directory(args.data_dir)
        if args.command == "inspect":
            return inspect(directory, out)
        return truncate(directory, _lsn(args.lsn), yes=args.yes, out=out)
    except Refusal as exc:
        print(f"kvrouter journal {args.command}: {exc}", file=err)
        return REFUSED


def inspect(directory: Path, out: TextIO) -> int:
    print(f"journal in {directory}", file=out)
    for snapshot in inspect_snapshots(directory):
        verdict = "ok" if snapshot.problem is None else f"UNREADABLE: {snapshot.problem}"
        print(f"snapshot lsn {snapshot.lsn}  {snapshot.name}  {snapshot.size} bytes  {verdict}", file=out)
    for entry in inspect_records(directory, head_bytes=MAX_PAYLOAD_BYTES):
        if isinstance(entry, DamagedFrame):
            print(
                f"DAMAGED  {entry.segment} at byte offset {entry.offset} (lsn {entry.lsn} expected): "
                f"{entry.problem}; {entry.remaining} bytes to the end of the file",
                file=out,
            )
        else:
            print(
                f"lsn {entry.lsn}  {entry.size} bytes  {entry.segment}@{entry.offset}  {describe_record(entry.head)}",
                file=out,
            )
    check = check_recovery(directory)
    print(_verdict(check, directory), file=out)
    return DONE if check.stop is None else WOULD_NOT_RECOVER


def truncate(directory: Path, lsn: int, *, yes: bool, out: TextIO) -> int:
    try:
        with lock_data_dir(directory):
            check = check_recovery(directory, upto=lsn)
            if check.stop is not None:
                raise Refusal(f"cannot truncate after lsn {lsn}: {_stop_line(check.stop, directory)}; nothing changed")
            try:
                plan = plan_truncation(directory, lsn)
            except CannotTruncate as exc:
                raise Refusal(f"cannot truncate after lsn {lsn}: {exc}; nothing changed") from None
            if not yes:
                print(f"would {_removal(plan)}", file=out)
                print("dry run: nothing changed; add --yes to truncate", file=out)
                return DONE
            done = truncate_after(directory, lsn)
            print(f"truncated: {_removal(done)}", file=out)
            print(_verdict(check_recovery(directory), directory), file=out)
            return DONE
    except DataDirectoryInUse:
        raise Refusal(f"the data directory {directory} is in use by a running kvrouter; stop it first") from None


def _removal(plan: Truncation) -> str:
    parts = [f"keep records up to lsn {plan.lsn}, remove {plan.records_removed} records ({plan.bytes_removed} bytes)"]
    if plan.segments_deleted:
        parts.append(f"delete segments {', '.join(plan.segments_deleted)}")
    if plan.segment_cut is not None:
        parts.append(f"cut {plan.segment_cut} at byte offset {plan.cut_offset}")
    if plan.snapshots_deleted:
        parts.append(f"delete snapshots {', '.join(plan.snapshots_deleted)}")
    return "; ".join(parts)


def _verdict(check: RecoveryCheck, directory: Path) -> str:
    start = f"snapshot lsn {check.snapshot_lsn}" if check.snapshot_lsn else "the first record"
    if check.stop is not None:
        return f"recovery: STOPS at lsn {check.stop.lsn}: {_stop_line(check.stop, directory)}"
    line = f"recovery: ok, from {start} plus {check.replayed} records to lsn {check.last_lsn} ({check.scopes} scopes)"
    torn = check.torn_tail
    if torn is not None:
        severity = "an ERROR" if torn.suspicious else "a warning"
        line += (
            f"; it cuts {torn.size} bytes at the end of {torn.segment} from byte offset {torn.offset} "
            f"({torn.why}) and logs {severity}"
        )
    return line


def _stop_line(stop: Stop, directory: Path) -> str:
    what = {
        "record": f"record {stop.lsn} cannot be used ({stop.problem})",
        "damage": f"record {stop.lsn} is damaged ({stop.problem})",
        "gap": stop.problem,
        "snapshot": f"the snapshot cannot be restored ({stop.problem})",
    }[stop.kind]
    if stop.kind == "snapshot":
        return f"{what}; restore the data directory from a backup"
    return f"{what}; cut before it: kvrouter journal truncate-after --data-dir {directory} --lsn {stop.lsn - 1} --yes"


def _existing_directory(raw: str) -> Path:
    directory = Path(raw)
    if not directory.is_dir():
        raise Refusal(f"--data-dir {raw} is not a directory; pass the data directory of a stopped service")
    return directory


def _lsn(raw: str) -> int:
    problems: list[str] = []
    value = parse_int("--lsn", raw, 0, U64_MASK, problems)
    if value is None:
        raise Refusal(problems[0])
    return value
