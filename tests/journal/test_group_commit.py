"""GroupCommit's rules on their own: no files, no trio, no clock."""

from __future__ import annotations

import pytest

from kvrouter.journal.group_commit import Batch, GroupCommit


def recorder() -> tuple[list[str], GroupCommit]:
    calls: list[str] = []
    return calls, GroupCommit(wake=lambda: calls.append("wake"))


def test_appends_get_consecutive_lsns_and_count_as_backlog() -> None:
    commit = GroupCommit(last_lsn=41)
    assert [commit.append(10), commit.append(0), commit.append(5)] == [42, 43, 44]
    assert (commit.last_lsn, commit.durable_lsn, commit.unwritten) == (44, 41, 15)


def test_a_written_batch_makes_everything_it_took_durable_and_nothing_after() -> None:
    calls, commit = recorder()
    commit.append(10)
    commit.append(20)
    batch = commit.take_batch()
    assert batch == Batch(last_lsn=2, nbytes=30)
    commit.append(7)  # appended while the batch is being written: not in it
    commit.batch_written(batch)
    assert (commit.durable_lsn, commit.unwritten, commit.last_lsn) == (2, 7, 3)
    assert calls == ["wake"]


def test_durable_callbacks_run_in_lsn_order_once_their_lsn_is_covered() -> None:
    calls, commit = recorder()
    for lsn in (1, 2, 3):
        assert commit.append(1) == lsn
        commit.call_when_durable(lsn, lambda lsn=lsn: calls.append(f"durable {lsn}"))
    assert calls == []
    first = Batch(last_lsn=2, nbytes=2)
    commit.batch_written(first)
    assert calls == ["wake", "durable 1", "durable 2"]
    commit.batch_written(commit.take_batch())
    assert calls == ["wake", "durable 1", "durable 2", "wake", "durable 3"]


def test_a_callback_for_a_durable_lsn_runs_at_once() -> None:
    calls, commit = recorder()
    commit.append(1)
    commit.batch_written(commit.take_batch())
    commit.call_when_durable(1, lambda: calls.append("now"))
    assert calls == ["wake", "now"]


def test_a_batch_whose_write_never_completed_is_part_of_the_next() -> None:
    commit = GroupCommit()
    commit.append(10)
    commit.take_batch()  # the write is interrupted: never reported
    commit.append(5)
    retry = commit.take_batch()
    assert retry == Batch(last_lsn=2, nbytes=15)
    commit.batch_written(retry)
    assert (commit.durable_lsn, commit.unwritten) == (2, 0)


def test_the_peak_backlog_is_the_largest_ever_taken_or_pending() -> None:
    commit = GroupCommit()
    commit.append(100)
    commit.append(50)
    commit.batch_written(commit.take_batch())
    commit.append(30)
    assert (commit.unwritten, commit.peak_unwritten) == (30, 150)
    commit.append(200)
    assert commit.peak_unwritten == 230  # not yet taken, still counted


def test_failure_calls_every_waiting_callback_and_wakes_the_shell() -> None:
    calls, commit = recorder()
    for lsn in (1, 2):
        commit.append(1)
        commit.call_when_durable(lsn, lambda lsn=lsn: calls.append(f"called {lsn}"))
    error = OSError("disk gone")
    commit.fail(error)
    assert calls == ["wake", "called 1", "called 2"]
    assert commit.failure is error and commit.durable_lsn == 0  # nothing became durable
    commit.append(1)
    commit.call_when_durable(3, lambda: calls.append("after failure"))
    assert calls[-1] == "after failure"  # late waiters learn at once, instead of hanging


def test_reporting_a_batch_twice_is_refused() -> None:
    commit = GroupCommit()
    commit.append(4)
    batch = commit.take_batch()
    commit.batch_written(batch)
    commit.append(1)
    commit.batch_written(commit.take_batch())
    with pytest.raises(ValueError, match="already reported"):
        commit.batch_written(batch)
