"""``kvrouter worker-topology``: publish a worker's topology, read from files, to selection services.

The seed ``topology-aware-kv-transfer.md``'s worker contract, as a command a worker's start script runs:

    kvrouter worker-topology --dir /etc/dynamo/topology --transfer-domain zone --policy required \\
        --register http://router:8092 --worker-id 7 [--model-name M --endpoint URL --block-size N ...]

* Each non-hidden, non-empty regular file under ``--dir`` is one topology domain: the file name is the domain,
  its content (whitespace stripped) the worker's value. Kubernetes projects such files through the Downward API
  (as symlinks into hidden ``..data`` directories, which this follows and skips).
* It waits until the ``--transfer-domain`` file exists and has content (pod labels can be projected after the
  worker starts), polling every ``--poll-secs``; after ``--timeout-secs`` it exits 1 with one line, so a bad
  topology source is visible at startup instead of a worker that routes without its policy.
* Then, for each ``--register`` URL, it PATCHes ``/workers/{id}`` with ``topology_domains`` (replaced
  wholesale), ``kv_transfer_domain``, ``kv_transfer_enforcement``, ``kv_transfer_preferred_weight`` (and
  ``worker_role`` if given); a service that does not know the worker yet gets a ``POST /workers`` with the
  registration flags too. It prints each service's record (one JSON line) and exits 0.

Defaults come from the environment variables of the same contract: ``DYN_TOPOLOGY_MOUNT_PATH`` (else
``/etc/dynamo/topology``), ``DYN_KV_TRANSFER_DOMAIN``, ``DYN_KV_TRANSFER_ENFORCEMENT`` (else ``required``),
``DYN_KV_TRANSFER_PREFERRED_WEIGHT``; flags win. Exit status: 0 registered everywhere; 1 the topology did not
appear in time or a service refused or could not be reached; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from kvrouter.actors.core.constraints import ENFORCEMENT_PREFERRED, ENFORCEMENTS, ROLES
from kvrouter.actors.core.router_config import parse_float, parse_int

DONE = 0
FAILED = 1
BAD_ARGUMENTS = 2
DEFAULT_MOUNT_PATH = "/etc/dynamo/topology"
HTTP_TIMEOUT_SECS = 10.0


class TopologyMissing(Exception):
    """The transfer-domain file did not appear (or stayed empty) within the timeout."""


def read_topology(directory: Path) -> dict[str, str]:
    """Every non-hidden, non-empty regular file under ``directory`` as ``{file name: stripped content}``."""
    domains: dict[str, str] = {}
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return domains  # not mounted (yet): nothing to read
    for name in names:
        path = directory / name
        if name.startswith(".") or not path.is_file():
            continue
        try:
            value = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            continue  # being rewritten, or not text: read again at the next poll
        if value:
            domains[name] = value
    return domains


def wait_for_domain(
    directory: Path,
    domain: str,
    *,
    timeout_secs: float,
    poll_secs: float,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, str]:
    """The topology once ``domain`` has a value; ``TopologyMissing`` if it has none after ``timeout_secs``."""
    deadline = monotonic() + timeout_secs
    while True:
        domains = read_topology(directory)
        if domain in domains:
            return domains
        remaining = deadline - monotonic()
        if remaining <= 0:
            raise TopologyMissing(
                f"topology domain {domain!r} has no non-empty file {directory / domain} after {timeout_secs:g} s: "
                "check the topology volume (--dir / DYN_TOPOLOGY_MOUNT_PATH) and --transfer-domain"
            )
        sleep(min(poll_secs, remaining))


def topology_fields(
    domains: Mapping[str, str], transfer_domain: str, policy: str, weight: float | None, role: str | None
) -> dict[str, Any]:
    """The catalog fields this worker publishes (PATCH body)."""
    fields: dict[str, Any] = {
        "topology_domains": dict(domains),
        "kv_transfer_domain": transfer_domain,
        "kv_transfer_enforcement": policy,
        "kv_transfer_preferred_weight": weight,
    }
    if role is not None:
        fields["worker_role"] = role
    return fields


def _request(method: str, url: str, body: Mapping[str, Any]) -> tuple[int, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_SECS) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None


def register(base_url: str, worker_id: int, fields: Mapping[str, Any], registration: Mapping[str, Any]) -> Any:
    """PATCH the worker's topology, or POST it with its registration when the service does not know it.

    Returns the record the service answered; raises ``RuntimeError`` with the service's reason otherwise.
    """
    base = base_url.rstrip("/")
    status, answer = _request("PATCH", f"{base}/workers/{worker_id}", fields)
    if status == 404:
        status, answer = _request("POST", f"{base}/workers", {**registration, **fields, "worker_id": worker_id})
    if status not in (200, 201):
        reason = answer.get("error") if isinstance(answer, dict) else answer
        raise RuntimeError(f"{base} answered {status}: {reason}")
    return answer


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrouter worker-topology",
        description="Read a worker's topology from files and publish it, with its KV-transfer policy, to "
        "selection services (POST/PATCH /workers).",
    )
    parser.add_argument(
        "--dir",
        default=env.get("DYN_TOPOLOGY_MOUNT_PATH") or DEFAULT_MOUNT_PATH,
        help="one file per topology domain (name = domain, content = value); default $DYN_TOPOLOGY_MOUNT_PATH, "
        f"else {DEFAULT_MOUNT_PATH}",
    )
    parser.add_argument(
        "--transfer-domain",
        default=env.get("DYN_KV_TRANSFER_DOMAIN") or None,
        help="the domain KV transfer stays within (waited for); default $DYN_KV_TRANSFER_DOMAIN",
    )
    parser.add_argument(
        "--policy",
        default=env.get("DYN_KV_TRANSFER_ENFORCEMENT") or "required",
        help="required: decode only in the prefill worker's domain; preferred: prefer it (default "
        "$DYN_KV_TRANSFER_ENFORCEMENT, else required)",
    )
    parser.add_argument(
        "--weight",
        default=env.get("DYN_KV_TRANSFER_PREFERRED_WEIGHT") or None,
        help="0-1, the preference's strength (--policy preferred only); default $DYN_KV_TRANSFER_PREFERRED_WEIGHT",
    )
    parser.add_argument(
        "--register", action="append", metavar="URL", required=True, help="a selection service (repeatable)"
    )
    parser.add_argument("--worker-id", required=True, help="the worker's id (u64)")
    parser.add_argument("--role", help=f"worker_role: {', '.join(ROLES)} (default: leave as it is)")
    parser.add_argument("--timeout-secs", default="60", help="how long to wait for the transfer-domain file (60)")
    parser.add_argument("--poll-secs", default="0.5", help="how often to look for it (0.5)")
    new = parser.add_argument_group("registration of a worker the service does not know yet (POST /workers)")
    new.add_argument("--model-name", default="default")
    new.add_argument("--tenant-id", default="default")
    new.add_argument("--endpoint")
    new.add_argument("--block-size")
    new.add_argument("--kv-events-endpoint")
    new.add_argument("--replay-endpoint")
    return parser


def _checked(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The parsed numbers and the registration, and every problem with the arguments (one line each)."""
    problems: list[str] = []
    values: dict[str, Any] = {}
    if not args.transfer_domain:
        problems.append("--transfer-domain (or DYN_KV_TRANSFER_DOMAIN) is required")
    if args.policy not in ENFORCEMENTS:
        problems.append(f"--policy={args.policy!r} must be required or preferred")
    values["worker_id"] = parse_int("--worker-id", args.worker_id, 0, 2**64 - 1, problems)
    values["timeout"] = parse_float("--timeout-secs", args.timeout_secs, 0.0, None, problems)
    values["poll"] = parse_float("--poll-secs", args.poll_secs, 0.001, 60.0, problems)
    weight = None
    if args.weight is not None:
        weight = parse_float("--weight", args.weight, 0.0, 1.0, problems)
        if args.policy != ENFORCEMENT_PREFERRED:
            problems.append("--weight applies only to --policy preferred")
    elif args.policy == ENFORCEMENT_PREFERRED:
        problems.append("--policy preferred needs --weight (0-1)")
    values["weight"] = weight
    if args.role is not None and args.role not in ROLES:
        problems.append(f"--role={args.role!r} must be one of {', '.join(ROLES)}")
    registration: dict[str, Any] = {"model_name": args.model_name, "tenant_id": args.tenant_id}
    for field in ("endpoint", "kv_events_endpoint", "replay_endpoint"):
        if getattr(args, field) is not None:
            registration[field] = getattr(args, field)
    if args.block_size is not None:
        registration["block_size"] = parse_int("--block-size", args.block_size, 1, 2**32 - 1, problems)
    values["registration"] = registration
    return values, problems


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, out: TextIO | None = None) -> int:
    environment = os.environ if env is None else env
    output = sys.stdout if out is None else out
    args = build_parser(environment).parse_args(argv)
    values, problems = _checked(args)
    if problems:
        print(f"kvrouter worker-topology: {'; '.join(problems)}", file=sys.stderr)
        return BAD_ARGUMENTS
    try:
        domains = wait_for_domain(
            Path(args.dir), args.transfer_domain, timeout_secs=values["timeout"], poll_secs=values["poll"]
        )
    except TopologyMissing as exc:
        print(f"kvrouter worker-topology: {exc}", file=sys.stderr)
        return FAILED
    fields = topology_fields(domains, args.transfer_domain, args.policy, values["weight"], args.role)
    status = DONE
    for url in args.register:
        try:
            record = register(url, values["worker_id"], fields, values["registration"])
        except (RuntimeError, OSError, ValueError) as exc:
            print(
                f"kvrouter worker-topology: cannot register worker {values['worker_id']} with {url}: {exc}",
                file=sys.stderr,
            )
            status = FAILED
            continue
        print(json.dumps(record, sort_keys=True), file=output)
    return status


if __name__ == "__main__":
    sys.exit(main())
