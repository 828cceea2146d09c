"""``kvrouter frontend``: parse the flags (named as in the seed's ``python -m dynamo.frontend``), start, stop on
SIGINT/SIGTERM. A bad flag or value is one line and exit 2; a port in use or a data directory in use too."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import attrs
import trio

from kvrouter import __version__
from kvrouter.actors.core.router_config import (
    InvalidSettings,
    RouterConfig,
    Setting,
    env_settings,
    parse_float,
    parse_int,
    resolve,
)
from kvrouter.actors.core.worker_endpoints import (
    EndpointAllowList,
    allow_list_problem,
    http_endpoint_problem,
    zmq_allow_list_problem,
)
from kvrouter.api.cli.dynamo_flags import (
    FRONTEND_INERT,
    HTTP_HOST_ENV,
    HTTP_PORT_ENV,
    add_inert_flags,
    http_host,
    http_port,
    inert_warnings,
)
from kvrouter.api.cli.fleet_flags import add_fleet_flags, fleet_options
from kvrouter.api.cli.http_flags import add_http_flags, check_exposure, http_options
from kvrouter.api.cli.one_line_parser import OneLineParser
from kvrouter.api.frontend.model_dir import load_model_dir
from kvrouter.api.frontend.options import DEFAULT_PORT, ROUTER_MODES, FrontendLimits, FrontendOptions, WorkerSpec
from kvrouter.api.frontend.remote_routing import SelectionUnreachable
from kvrouter.api.frontend.remote_service import run_remote_frontend
from kvrouter.api.frontend.selection_flags import add_selection_flag, selection_urls
from kvrouter.api.frontend.service import file_workers, run_frontend, run_until_signal
from kvrouter.api.frontend.tokenizers import TokenizerUnavailable, load_tokenizer
from kvrouter.api.process import log_setup
from kvrouter.api.process.exit_reasons import BAD_CONFIGURATION, ServiceContext, explain
from kvrouter.api.process.exposure import add_worker_endpoint_flag, worker_endpoint_allow
from kvrouter.journal.store import Durability

log = logging.getLogger("kvrouter.frontend")
LIMITS = FrontendLimits()


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="kvrouter frontend",
        description="An OpenAI-compatible frontend that routes each request to a worker with the selection "
        "service's core (KV-aware by default) and drives its lifecycle.",
    )
    parser.add_argument("--version", action="version", version=f"kvrouter {__version__}")
    parser.add_argument("--port", "--http-port", help=f"HTTP port, 0 for any ({HTTP_PORT_ENV}; default {DEFAULT_PORT})")
    parser.add_argument(
        "--host",
        "--http-host",
        help=f"address to bind ({HTTP_HOST_ENV}; default 127.0.0.1; another address needs --auth-token-file or "
        "--insecure-no-auth)",
    )
    _add_routing_flags(parser)
    add_selection_flag(parser)
    parser.add_argument(
        "--data-dir", metavar="DIR", help="journal of the catalog and bookings (default: in memory, nothing kept)"
    )
    parser.add_argument(
        "--durability",
        choices=[d.value for d in Durability],
        default=Durability.ALWAYS.value,
        help="with --data-dir: always (fsync before each answer, default), batch, off",
    )
    parser.add_argument("--fresh", action="store_true", help="with --data-dir: start empty, discarding the journal")
    parser.add_argument(
        "--workers",
        metavar="URL[=KV],...",
        default="",
        help="comma-separated worker endpoints to register at startup, each optionally =its KV-events endpoint "
        "(http://127.0.0.1:8101=tcp://127.0.0.1:5601); workers may also register with POST /workers",
    )
    add_worker_endpoint_flag(parser)
    parser.add_argument("--model-name", default="mock", help="the model the --workers serve (default mock)")
    parser.add_argument(
        "--block-size", "--kv-cache-block-size", default="16", help="KV block size of the --workers (default 16)"
    )
    parser.add_argument(
        "--tokenizer", metavar="FILE", help="a Hugging Face tokenizer.json (needs kvrouter[hf]); default: built-in"
    )
    parser.add_argument(
        "--model-path",
        metavar="DIR",
        help="a model directory (tokenizer.json, tokenizer_config.json, config.json): tokenize and render chats "
        "with the model's own tokenizer and chat template, as its engine does (needs kvrouter[hf])",
    )
    _add_limit_flags(parser)
    parser.add_argument("--seed", metavar="N", help="seed of the random tie-breaks (default: fresh per process)")
    add_fleet_flags(parser)
    add_http_flags(parser)
    add_inert_flags(parser, FRONTEND_INERT)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def _add_routing_flags(parser: argparse.ArgumentParser) -> None:
    """How a worker is chosen."""
    parser.add_argument(
        "--router-mode", help=f"{' | '.join(ROUTER_MODES)} (DYN_ROUTER_MODE; default kv; round_robin alike)"
    )
    parser.add_argument(
        "--kv-overlap-score-weight",
        metavar="W",
        help="weight of the prefill blocks in the cost, >= 0 (default 1; 0: load balancing only)",
    )
    parser.add_argument(
        "--router-temperature", metavar="T", help="softmax temperature of the choice, >= 0 (default 0: cheapest)"
    )
    parser.add_argument(
        "--router-kv-events",
        "--kv-events",
        dest="kv_events",
        action=argparse.BooleanOptionalAction,
        help="listen to the workers' KV events (default); --no-router-kv-events: predict their caches from the "
        "routing decisions",
    )
    parser.add_argument(
        "--busy-threshold",
        metavar="F",
        help="0-1: a worker whose active KV blocks exceed this fraction of its total is busy and skipped (default off)",
    )


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """What a client may ask of the frontend, and how long a worker may take."""
    parser.add_argument(
        "--max-in-flight",
        metavar="N",
        help=f"requests proxied at once; beyond, 503 (default {LIMITS.max_in_flight})",
    )
    parser.add_argument(
        "--max-body-bytes", metavar="N", help=f"a client's request body limit (default {LIMITS.body_limit})"
    )
    parser.add_argument(
        "--max-prompt-tokens", metavar="N", help=f"tokens in a prompt, 400 beyond (default {LIMITS.max_prompt_tokens})"
    )
    parser.add_argument(
        "--tokenizer-threads",
        metavar="N",
        help=f"threads tokenizing long prompts at once, off the event loop (default {LIMITS.tokenizer_threads})",
    )
    parser.add_argument(
        "--max-tokenizing-chars",
        metavar="N",
        help="characters of long prompts waiting for or in a tokenizer thread; beyond, 503 "
        f"(default {LIMITS.tokenize_queue_chars})",
    )
    parser.add_argument(
        "--upstream-connect-timeout-secs",
        metavar="S",
        help=f"to reach a worker; then another worker is tried once (default {LIMITS.connect_timeout:g})",
    )
    parser.add_argument(
        "--upstream-read-timeout-secs",
        metavar="S",
        help=f"a worker silent this long fails the request (504; default {LIMITS.read_timeout:g})",
    )
    parser.add_argument(
        "--request-timeout-secs",
        metavar="S",
        help=f"a whole proxied request (504; default {LIMITS.request_timeout:g})",
    )
    parser.add_argument(
        "--worker-cool-down-secs",
        metavar="S",
        help="a worker that failed (refused, unreachable, 5xx) is out of selection this long, then probed on "
        f"/health (default {LIMITS.breaker_cool_down:g})",
    )
    parser.add_argument(
        "--worker-max-cool-down-secs",
        metavar="S",
        help="each failed probe doubles the cool-down, up to this (default "
        f"{LIMITS.breaker_max_cool_down:g}); docs/frontend.md#dead-workers",
    )


def options_from(args: argparse.Namespace, env: dict[str, str]) -> FrontendOptions:
    """The options ``args`` describe; raises ``InvalidSettings`` naming every bad flag."""
    problems: list[str] = []
    warnings: list[str] = []
    raw_port, port_name = http_port(args.port, env)
    port = parse_int(port_name, raw_port, 0, 65535, problems) if raw_port is not None else DEFAULT_PORT
    host = http_host(args.host, env, "127.0.0.1")
    warnings.extend(inert_warnings(args, FRONTEND_INERT))
    router = _router(args, env, problems)
    block_size = parse_int("--block-size", args.block_size, 1, 1 << 20, problems)
    limits = _limits(args, problems)
    http, auth = http_options(args, env, problems, warnings)
    if host:
        check_exposure(host, auth, args, problems, warnings)
    limits = attrs.evolve(limits, body_timeout=http.body_timeout)
    allow = worker_endpoint_allow(args.worker_endpoint_allow, problems)
    if router is not None and allow is not None:
        router = attrs.evolve(router, worker_endpoint_allow=allow)
    workers = _workers(args.workers, allow, problems)
    seed = parse_int("--seed", args.seed, 0, 2**64 - 1, problems) if args.seed is not None else None
    if not args.model_name:
        problems.append("--model-name='' is empty")
    tokenizer, model_path = _tokenizer_paths(args, problems, warnings)
    if args.data_dir == "":
        problems.append("--data-dir='' is empty; give a directory or leave it out (journal in memory)")
    fleet = fleet_options(
        args,
        env,
        problems,
        warnings,
        data_dir=Path(args.data_dir) if args.data_dir else None,
        file_parser=file_workers(args.model_name, block_size or 16),
    )
    if fleet.discovery_backend == "etcd":
        warnings.append(
            "--discovery-backend etcd: Dynamo's workers answer on Dynamo's request plane, which the frontend does not "
            "speak: a request routed to a worker without an http(s) endpoint fails there (route Dynamo workers with "
            "kvrouter select-service; docs/fleet.md)"
        )
    remote = selection_urls(args, fleet, problems)
    if problems or router is None:
        raise InvalidSettings(problems)
    for warning in warnings:
        log.warning("%s", warning)
    return FrontendOptions(
        host=host,
        port=port if port is not None else DEFAULT_PORT,
        data_dir=Path(args.data_dir) if args.data_dir else None,
        durability=Durability(args.durability),
        fresh=args.fresh,
        router=router,
        workers=workers,
        model_name=args.model_name,
        block_size=block_size or 16,
        tokenizer=tokenizer,
        model_path=model_path,
        limits=limits,
        http=http,
        auth=auth,
        seed=seed,
        fleet=fleet,
        selection_urls=remote,
    )


def _tokenizer_paths(
    args: argparse.Namespace, problems: list[str], warnings: list[str]
) -> tuple[Path | None, Path | None]:
    """``--tokenizer FILE`` or ``--model-path DIR`` (not both), each loaded once here so a bad one stops the start."""
    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    model_path = Path(args.model_path) if args.model_path else None
    if args.model_path == "":
        problems.append("--model-path='' is empty; give a model directory or leave it out")
    if tokenizer is not None and model_path is not None:
        problems.append("--tokenizer and --model-path both name a tokenizer; give one (--model-path reads the "
                        "directory's tokenizer.json)")  # fmt: skip
        return None, None
    try:
        if tokenizer is not None:
            load_tokenizer(tokenizer)
        if model_path is not None:
            model = load_model_dir(model_path)
            if model.template_missing:
                warnings.append(model.template_missing)
    except TokenizerUnavailable as exc:
        problems.append(str(exc))
    return tokenizer, model_path


def _frontend_mode(text: str) -> str:
    """A router mode as the frontend spells it (``round_robin`` and ``Round-Robin`` are ``round-robin``)."""
    return text.strip().lower().replace("_", "-")


def _router(args: argparse.Namespace, env: dict[str, str], problems: list[str]) -> RouterConfig | None:
    """The routing flags over the environment's settings (None, with problems named, if any is bad)."""
    flags: dict[str, Setting] = {}
    if args.router_mode is not None:  # else DYN_ROUTER_MODE, else kv
        flags["router_mode"] = ("--router-mode", args.router_mode)
        if _frontend_mode(args.router_mode) not in ROUTER_MODES:
            problems.append(f"--router-mode={args.router_mode!r} is not a router mode (use {', '.join(ROUTER_MODES)})")
            flags.pop("router_mode")
    if args.kv_overlap_score_weight is not None:
        flags["overlap_score_weight"] = ("--kv-overlap-score-weight", args.kv_overlap_score_weight)
    if args.router_temperature is not None:
        flags["router_temperature"] = ("--router-temperature", args.router_temperature)
    if args.kv_events is not None:
        flags["use_kv_events"] = (
            "--router-kv-events" if args.kv_events else "--no-router-kv-events",
            "true" if args.kv_events else "false",
        )
    if args.busy_threshold is not None:
        flags["active_decode_blocks_threshold"] = ("--busy-threshold", args.busy_threshold)
    from_env = env.get("DYN_ROUTER_MODE")
    if "router_mode" not in flags and from_env is not None and _frontend_mode(from_env) not in ROUTER_MODES:
        problems.append(f"DYN_ROUTER_MODE={from_env!r} is not a frontend mode (use {', '.join(ROUTER_MODES)})")
        return None
    try:
        router = resolve(env_settings(env), flags)
    except InvalidSettings as exc:
        problems.extend(exc.problems)
        return None
    if router.router_mode.replace("_", "-") not in ROUTER_MODES:  # DYN_ROUTER_MODE naming a service-only mode
        problems.append(
            f"DYN_ROUTER_MODE={router.router_mode!r} is not a frontend mode (use {', '.join(ROUTER_MODES)})"
        )
        return None
    return router


def _limits(args: argparse.Namespace, problems: list[str]) -> FrontendLimits:
    """What a client may ask and how long a worker may take (the defaults for flags not given)."""
    cool_down, max_cool_down = _cool_downs(args, problems)
    return FrontendLimits(
        max_in_flight=_int(args.max_in_flight, "--max-in-flight", LIMITS.max_in_flight, problems),
        body_limit=_int(args.max_body_bytes, "--max-body-bytes", LIMITS.body_limit, problems),
        max_prompt_tokens=_int(args.max_prompt_tokens, "--max-prompt-tokens", LIMITS.max_prompt_tokens, problems),
        tokenizer_threads=_threads(args.tokenizer_threads, problems),
        tokenize_queue_chars=_int(
            args.max_tokenizing_chars, "--max-tokenizing-chars", LIMITS.tokenize_queue_chars, problems
        ),
        connect_timeout=_secs(
            args.upstream_connect_timeout_secs, "--upstream-connect-timeout-secs", LIMITS.connect_timeout, problems
        ),
        read_timeout=_secs(
            args.upstream_read_timeout_secs, "--upstream-read-timeout-secs", LIMITS.read_timeout, problems
        ),
        request_timeout=_secs(args.request_timeout_secs, "--request-timeout-secs", LIMITS.request_timeout, problems),
        breaker_cool_down=cool_down,
        breaker_max_cool_down=max_cool_down,
    )


def _cool_downs(args: argparse.Namespace, problems: list[str]) -> tuple[float, float]:
    """The circuit breakers' first cool-down and its cap (the cap no shorter than the first)."""
    first = _secs(args.worker_cool_down_secs, "--worker-cool-down-secs", LIMITS.breaker_cool_down, problems)
    cap = _secs(args.worker_max_cool_down_secs, "--worker-max-cool-down-secs", LIMITS.breaker_max_cool_down, problems)
    if cap < first:
        problems.append(f"--worker-max-cool-down-secs={cap:g} is shorter than --worker-cool-down-secs={first:g}")
    return first, cap


def _int(raw: str | None, flag: str, default: int, problems: list[str]) -> int:
    if raw is None:
        return default
    value = parse_int(flag, raw, 1, 1 << 40, problems)
    return value if value is not None else default


def _threads(raw: str | None, problems: list[str]) -> int:
    if raw is None:
        return LIMITS.tokenizer_threads
    value = parse_int("--tokenizer-threads", raw, 1, 64, problems)
    return value if value is not None else LIMITS.tokenizer_threads


def _secs(raw: str | None, flag: str, default: float, problems: list[str]) -> float:
    if raw is None:
        return default
    value = parse_float(flag, raw, 0.001, 86_400.0, problems)
    return value if value is not None else default


def _workers(raw: str, allow: EndpointAllowList | None, problems: list[str]) -> tuple[WorkerSpec, ...]:
    specs = []
    for item in filter(None, (part.strip() for part in raw.split(","))):
        endpoint, _, kv = item.partition("=")
        problem = (http_endpoint_problem(endpoint) if endpoint else "an empty worker endpoint") or allow_list_problem(
            "endpoint", endpoint, allow
        )
        if problem is not None:
            problems.append(f"--workers: {problem}")
            continue
        if kv and not kv.startswith(("tcp://", "ipc://")):
            problems.append(f"--workers: the KV-events endpoint {kv!r} of {endpoint} must be tcp:// or ipc://")
            continue
        kv_problem = zmq_allow_list_problem("KV-events endpoint", kv, allow)
        if kv_problem is not None:
            problems.append(f"--workers: {kv_problem}")
            continue
        specs.append(WorkerSpec(endpoint, kv or None))
    return tuple(specs)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_setup.configure(args.log_level, "frontend")
    try:
        options = options_from(args, dict(os.environ))
    except InvalidSettings as exc:
        log.error("cannot start: %s", "; ".join(exc.problems))
        return BAD_CONFIGURATION
    try:
        runner = run_remote_frontend if options.selection_urls else run_frontend
        trio.run(partial(run_until_signal, options, runner))
    except BaseException as exc:  # every failure becomes one line
        return _explain(exc, options)
    return 0


def _explain(exc: BaseException, options: FrontendOptions) -> int:
    unreachable = _selection_unreachable(exc)
    if unreachable is not None:
        log.error("cannot start: %s", unreachable)
        return BAD_CONFIGURATION
    context = ServiceContext(options.host, options.port, options.data_dir or Path("(memory)"))
    reason = explain(exc, context, journal_open=False)
    log.error("%s", reason.message, exc_info=exc if reason.unexpected else None)
    return reason.status


def _selection_unreachable(exc: BaseException) -> SelectionUnreachable | None:
    """``SelectionUnreachable`` within ``exc`` (it may escape ``trio.run`` inside exception groups), if any."""
    if isinstance(exc, SelectionUnreachable):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _selection_unreachable(inner)
            if found is not None:
                return found
    return None


if __name__ == "__main__":
    sys.exit(main())
