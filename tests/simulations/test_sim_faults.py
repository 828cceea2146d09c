"""Fault injection: each fault happens, the run survives it, and its invariant would catch a breach."""

from __future__ import annotations

import hashlib

import attrs
import orjson
import pytest

from kvrouter.actors.core.kv_wire import AllBlocksCleared, KvBatch
from kvrouter.actors.peers.replica_wire import Free, decode
from kvrouter.simulations import cli
from kvrouter.simulations.cluster import Cluster, ClusterOptions, ClusterRun, InvariantViolation, simulate_policy
from kvrouter.simulations.faults import (
    FaultSpecError,
    KvLoss,
    KvNoRemovals,
    RouterCrash,
    SyncFaults,
    WorkerCrash,
    parse_faults,
)
from kvrouter.simulations.generators import synthetic
from kvrouter.simulations.replication import SimReplicator
from kvrouter.simulations.router import RouterReplica
from kvrouter.simulations.timing import EngineParams

TRACE = synthetic("shared-prefix:requests=120,rate=20,prompts=4", 7)


def run(faults: str, policy: str = "kv", replicas: int = 1, seed: int = 1) -> ClusterRun:
    options = ClusterOptions(
        workers=3,
        policy=policy,
        seed=seed,
        engine=EngineParams(num_blocks=1_024),
        replicas=replicas,
        faults=parse_faults(faults),
    )
    return simulate_policy(TRACE, options)


def test_a_spec_parses_into_a_plan() -> None:
    spec = "router-crash@2s:down=500ms; worker-crash@1500:worker=2;kv-loss@1s:worker=1,batches=3,replay=no"
    plan = parse_faults(spec)
    assert plan.timed == (
        KvLoss(1000.0, 1, 3, replay=False),
        WorkerCrash(1500.0, 2),
        RouterCrash(2000.0, 0, 500.0),
    )
    assert parse_faults("sync-drop=0.1;sync-delay=5ms;sync-until=10s").sync == SyncFaults(0.1, 5.0, 0.0, 10_000.0)
    assert parse_faults("").empty
    assert parse_faults("kv-no-removals@3s:worker=2").timed == (KvNoRemovals(3000.0, 2),)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("worker-crash@1s", "worker=W is required"),
        ("worker-crash:worker=1", "expected KIND@TIME"),
        ("meteor@1s", "unknown fault 'meteor'"),
        ("sync-drop=2", "must be between 0 and 1"),
        ("kv-loss@x:worker=1", "is not a time"),
        ("router-crash@1s:colour=red", "unknown parameter"),
        ("kv-no-removals@1s", "worker=W is required"),
    ],
)
def test_a_bad_spec_names_the_item(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError, match=message):
        parse_faults(spec)


def test_worker_crash_fails_its_requests_and_clears_its_blocks_everywhere() -> None:
    result = run("worker-crash@2s:worker=2")
    failed = [r for r in result.records if r.rejected == "failed: worker crashed"]
    assert result.faults.worker_crashes == 1 and len(failed) == result.faults.requests_failed > 0
    assert all(r.end_ms is not None for r in result.records if r.rejected is None)


def test_a_worker_restart_the_router_does_not_hear_of_breaks_the_index_invariant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def deaf(self: RouterReplica, worker_id: int, dp_rank: int) -> None:
        return None

    monkeypatch.setattr(RouterReplica, "reset_kv_stream", deaf)
    with pytest.raises(InvariantViolation, match="restarted empty but the index still has its blocks"):
        run("worker-crash@2s:worker=2")


def index_digest(monkeypatch: pytest.MonkeyPatch, faults: str) -> tuple[str, ClusterRun]:
    """The router's final KV index as a digest, under round robin (so routing does not depend on it)."""
    captured: dict[str, bytes] = {}
    finish = Cluster._finish

    async def capture(self: Cluster) -> None:
        await finish(self)
        state = self.routers[0].state()
        assert state is not None
        captured["index"] = orjson.dumps(state.selection.index.to_snapshot(), option=orjson.OPT_SORT_KEYS)

    monkeypatch.setattr(Cluster, "_finish", capture)
    result = run(faults, "round_robin")
    return hashlib.sha256(captured["index"]).hexdigest(), result


def test_lost_kv_batches_are_replayed_from_the_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    clean, _ = index_digest(monkeypatch, "")
    replayed, result = index_digest(monkeypatch, "kv-loss@1s:worker=1,batches=4")
    assert result.faults.kv_batches_lost == 4 and result.faults.kv_batches_replayed == 4
    assert replayed == clean  # the gap was filled: the index is what it would have been
    stale, result = index_digest(monkeypatch, "kv-loss@1s:worker=1,batches=4,replay=no")
    assert result.faults.kv_gaps_unrepaired == 4
    assert stale != clean


def test_a_publisher_that_loses_its_evictions_leaves_the_router_predicting_blocks_that_are_gone() -> None:
    def over_predicted(faults: str) -> int:
        options = ClusterOptions(workers=3, seed=1, engine=EngineParams(num_blocks=256), faults=parse_faults(faults))
        result = simulate_policy(synthetic("shared-prefix:requests=300,rate=20,prompts=6", 7), options)
        assert result.kv_blocks_evicted > 0  # small caches: there are evictions to lose
        cap = 64  # the engine block size: compare whole blocks, as the report does
        return sum(
            1
            for r in result.records
            if r.predicted_tokens is not None
            and r.cached_tokens is not None
            and min(r.predicted_tokens, (r.input_tokens - 1) // cap * cap) > r.cached_tokens
        )

    assert over_predicted("kv-no-removals@0s:worker=1") > over_predicted("")


def test_router_crash_recovers_from_its_journal_and_catches_up() -> None:
    result = run("router-crash@2s:down=1500ms")
    assert result.faults.router_crashes == 1
    assert result.faults.kv_batches_replayed > 0  # what it missed while down came back from the workers
    # Requests that arrived while it was down waited for it: every request still completed.
    assert all(r.end_ms is not None for r in result.records)
    assert max(r.first_token_ms - r.arrival_ms for r in result.records) > 1_000


def test_replicas_stay_in_step_and_agree_at_the_end() -> None:
    result = run("", replicas=2)
    assert result.faults.sync_sent > 0 and not result.faults.expiry_horizon_used


def test_lossy_replica_sync_heals_by_expiry_and_replicas_agree() -> None:
    result = run("sync-drop=0.3;sync-delay=10ms;sync-reorder=0.3", replicas=2)
    assert result.faults.sync_dropped > 0 and result.faults.sync_reordered > 0
    assert result.faults.expiry_horizon_used


def drop_frees(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica-sync transport that silently loses every free (a bug the checks must notice)."""
    receive = SimReplicator.receive

    async def lossy(self: SimReplicator, frames: list[bytes], peer: str = "") -> None:
        if not isinstance(decode(frames).data, Free):
            await receive(self, frames, peer)

    monkeypatch.setattr(SimReplicator, "receive", lossy)


def test_replicas_that_miss_frees_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    drop_frees(monkeypatch)
    with pytest.raises(InvariantViolation, match="still booked"):
        run("", replicas=2)  # no sync fault announced, so no expiry horizon excuses the leftovers


def test_a_violation_prints_the_seed_step_and_command(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    drop_frees(monkeypatch)
    argv = ["--synthetic", "chat:sessions=6", "--replicas", "2", "--seed", "9", "--no-progress", "--jobs", "1"]
    status = cli.main(argv)
    err = capsys.readouterr().err
    assert status == 1
    assert "invariant violated at step" in err and "--seed 9" in err


def test_a_cache_reset_clears_the_routers_view() -> None:
    result = run("cache-reset@1s:worker=1;cache-reset@3s:worker=2", policy="round_robin")
    assert result.faults.cache_resets == 2


def test_a_cache_reset_the_router_misses_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    ingest = RouterReplica.ingest

    async def no_clears(self: RouterReplica, worker_id: int, dp_rank: int, seq: int, batch: KvBatch) -> None:
        events = tuple(e for e in batch.events if not isinstance(e, AllBlocksCleared))
        await ingest(self, worker_id, dp_rank, seq, attrs.evolve(batch, events=events))

    monkeypatch.setattr(RouterReplica, "ingest", no_clears)
    with pytest.raises(InvariantViolation, match="reset its prefix cache but the index still has its blocks"):
        run("cache-reset@2s:worker=1", policy="round_robin")


def test_faults_are_reproducible() -> None:
    spec = "sync-drop=0.2;sync-reorder=0.2;worker-crash@2s:worker=1;router-crash@3s:router=1,down=500ms"
    first, again = run(spec, replicas=2, seed=4), run(spec, replicas=2, seed=4)
    assert first.journal_digest == again.journal_digest
    assert attrs.asdict(first.faults) == attrs.asdict(again.faults)
    assert [r.end_ms for r in first.records] == [r.end_ms for r in again.records]
