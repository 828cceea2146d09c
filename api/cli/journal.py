"""``kvrouter journal``: look at a stopped service's journal, move one record out, cut it after an lsn (repairs).

Recovery refuses to start on a record it cannot use and names its lsn in one line, with the command
that repairs it:

    kvrouter journal inspect --data-dir D                       # records, snapshots, where recovery stops
    kvrouter journal quarantine --data-dir D --lsn N            # what moving record N out would do (dry run)
    kvrouter journal quarantine --data-dir D --lsn N --yes      # move it out (kept beside the log); keep the rest
    kvrouter journal truncate-after --data-dir D --lsn N        # what the cut would remove (dry run)
    kvrouter journal truncate-after --data-dir D --lsn N --yes  # cut: records after N are gone for good

Both repairs name the clients' acknowledged writes they would drop (``actors/persistence/client_writes.py``).

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
from kvrouter.actors.persistence.client_writes import BOOKING, ClientWrites
from kvrouter.actors.persistence.journal_check import RecoveryCheck, Stop, check_recovery, describe_record
from kvrouter.api.process import data_dir
from kvrouter.api.process.main import lock_data_dir
from kvrouter.journal.frames import MAX_PAYLOAD_BYTES
from kvrouter.journal.repair import (
    CannotQuarantine,
    CannotTruncate,
    DamagedFrame,
    Quarantine,
    QuarantinedRecord,
    RecordInfo,
    Truncation,
    inspect_records,
    inspect_snapshots,
    plan_quarantine,
    plan_truncation,
    quarantine,
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
    commands = parser.add_subparsers(dest="command", required=True, metavar="{inspect,quarantine,truncate-after}")
    inspect = commands.add_parser(
        "inspect",
        help="list records and snapshots, and where recovery would stop (changes nothing)",
        description="List every record (lsn, size, place, scope and events) and snapshot, check them, and "
        "replay the log as recovery would, without changing a byte. Exit 1 if recovery would stop.",
    )
    inspect.add_argument("--data-dir", metavar="DIR", required=True, help="the service's --data-dir")
    moved = commands.add_parser(
        "quarantine",
        help="move one damaged record out of the log, keep every other (dry run unless --yes)",
        description="Move record --lsn out of the log into a file beside it (quarantine-<lsn>.frame, its bytes "
        "exactly as they were), leaving a placeholder recovery passes over; every other record stays. It takes a "
        "damaged record, or one recovery cannot use. Refused (exit 2, nothing changed) otherwise. The service must "
        "be stopped.",
    )
    moved.add_argument("--data-dir", metavar="DIR", required=True, help="the service's --data-dir")
    moved.add_argument("--lsn", metavar="N", required=True, help="the record to move out")
    moved.add_argument("--yes", action="store_true", help="really move it (without it: show what would happen)")
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
        if args.command == "quarantine":
            return move_out(directory, _lsn(args.lsn), yes=args.yes, out=out)
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
        print(_entry_line(entry), file=out)
    check = check_recovery(directory)
    print(_verdict(check, directory), file=out)
    return DONE if check.stop is None else WOULD_NOT_RECOVER


def _entry_line(entry: RecordInfo | DamagedFrame | QuarantinedRecord) -> str:
    if isinstance(entry, QuarantinedRecord):
        return f"lsn {entry.lsn}  QUARANTINED  {entry.size} bytes  {entry.segment}@{entry.offset}  (moved out)"
    if isinstance(entry, RecordInfo):
        return f"lsn {entry.lsn}  {entry.size} bytes  {entry.segment}@{entry.offset}  {describe_record(entry.head)}"
    where = f"{entry.segment} at byte offset {entry.offset} (lsn {entry.lsn} expected): {entry.problem}"
    if entry.end is None:
        return f"DAMAGED  {where}; {entry.remaining} bytes to the end of the file"
    kind = "rebuildable: recovery skips it" if entry.rebuildable else "not rebuildable: recovery stops here"
    size = entry.end - entry.offset
    return f"DAMAGED  {where}; {size} bytes, {kind}; it reads as: {describe_record(entry.head)}"


def move_out(directory: Path, lsn: int, *, yes: bool, out: TextIO) -> int:
    """``quarantine``: a damaged record, or one recovery stops at (a poison record), moved out of the log."""
    try:
        with lock_data_dir(directory):
            check = check_recovery(directory)
            poison = check.stop is not None and check.stop.kind == "record" and check.stop.lsn == lsn
            try:
                plan = plan_quarantine(directory, lsn, intact=poison)
            except CannotQuarantine as exc:
                raise Refusal(f"cannot quarantine lsn {lsn}: {exc}; nothing changed") from None
            writes = _client_writes([plan.head], directory)
            if not yes:
                print(f"would {_moving(plan, directory, done=False)}", file=out)
                print(f"the record reads as: {describe_record(plan.head)}{writes}", file=out)
                print("dry run: nothing changed; add --yes to quarantine", file=out)
                return DONE
            done = quarantine(directory, lsn, intact=poison)
            print(f"quarantined: {_moving(done, directory, done=True)}", file=out)
            print(f"the record read as: {describe_record(done.head)}{writes}", file=out)
            print(_verdict(check_recovery(directory), directory), file=out)
            return DONE
    except DataDirectoryInUse:
        raise Refusal(f"the data directory {directory} is in use by a running kvrouter; stop it first") from None


def _moving(plan: Quarantine, directory: Path, *, done: bool) -> str:
    why = f"damaged: {plan.problem}" if plan.problem is not None else "intact, but recovery cannot use it"
    move, leave, stay = ("moved", "left", "stayed") if done else ("move", "leave", "stays")
    return (
        f"{move} record {plan.lsn} ({why}; {plan.size} bytes in {plan.segment} at byte offset {plan.offset}) to "
        f"{directory / plan.kept_in} and {leave} a placeholder in its place; every other record {stay}"
    )


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
            dropped = _dropped_writes(directory, lsn)
            if not yes:
                print(f"would {_removal(plan)}", file=out)
                print(f"among them, acknowledged client writes: {dropped}", file=out)
                for line in _instead(directory, lsn):
                    print(line, file=out)
                print("dry run: nothing changed; add --yes to truncate", file=out)
                return DONE
            done = truncate_after(directory, lsn)
            print(f"truncated: {_removal(done)}", file=out)
            print(f"among them, acknowledged client writes: {dropped}", file=out)
            print(_verdict(check_recovery(directory), directory), file=out)
            return DONE
    except DataDirectoryInUse:
        raise Refusal(f"the data directory {directory} is in use by a running kvrouter; stop it first") from None


def _dropped_writes(directory: Path, lsn: int) -> str:
    """The client writes among the records a cut after ``lsn`` drops (each read whole, one at a time)."""
    writes = ClientWrites()
    for entry in inspect_records(directory, after_lsn=lsn, head_bytes=MAX_PAYLOAD_BYTES):
        if isinstance(entry, RecordInfo):
            writes.add(entry.head)
    text = writes.describe(_booking(directory))
    if writes.other:
        text += f"; besides them {writes.other} records no client wrote (workers' KV events, expiries)"
    if writes.undecodable:
        text += f"; {writes.undecodable} records this build cannot decode"
    return text


def _client_writes(payloads: list[bytes], directory: Path) -> str:
    writes = ClientWrites()
    for payload in payloads:
        writes.add(payload)
    return f" (an acknowledged client write: {writes.describe(_booking(directory))})" if writes.total else ""


def _booking(directory: Path) -> str:
    """What the journal's service calls a booking."""
    try:
        owner = data_dir.owner(directory)
    except data_dir.DataDirectoryOwned:
        owner = None
    return "reservation" if owner == data_dir.SELECTION_SERVICE else BOOKING


def _instead(directory: Path, lsn: int) -> list[str]:
    """When the cut would drop intact records only because of one damaged record, name the repair that keeps them."""
    for entry in inspect_records(directory, after_lsn=lsn, head_bytes=0):
        if isinstance(entry, DamagedFrame) and entry.lsn > lsn and entry.end is not None:
            return [
                f"record {entry.lsn} is damaged and the records after it are intact: to lose only that one, run "
                f"`kvrouter journal quarantine --data-dir {directory} --lsn {entry.lsn} --yes` instead"
            ]
    return []


def _removal(plan: Truncation) -> str:
    removed = f"{plan.records_removed} records"
    if plan.damaged_removed:
        removed += f" and {plan.damaged_removed} damaged"
    if plan.quarantined_removed:
        removed += f" and {plan.quarantined_removed} quarantine placeholders"
    if plan.unreadable_bytes:
        removed += f" ({plan.unreadable_bytes} bytes after damage could not be read as records)"
    parts = [f"keep records up to lsn {plan.lsn}, remove {removed}, {plan.bytes_removed} bytes in all"]
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
    if check.skipped:
        shown = ", ".join(map(str, check.skipped[:5])) + (", ..." if len(check.skipped) > 5 else "")
        line += f"; it passes over {len(check.skipped)} damaged rebuildable or quarantined records (lsn {shown})"
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
    cut = f"kvrouter journal truncate-after --data-dir {directory} --lsn {stop.lsn - 1} --yes"
    if stop.movable:
        move = f"kvrouter journal quarantine --data-dir {directory} --lsn {stop.lsn} --yes"
        return f"{what}; move only it out of the log: {move} (or cut before it: {cut})"
    return f"{what}; cut before it: {cut}"


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
