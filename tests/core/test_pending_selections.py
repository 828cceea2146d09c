"""The pending-selection cache stays within one byte budget shared by every scope (1.6.1's
--selection-cache-max-bytes): 60 /select calls with huge prompts once held 943 MiB."""

from __future__ import annotations

from kvrouter.actors.core.commands import Reserve
from kvrouter.actors.core.pending import PendingSelections, SelectionCacheBudget, entry_bytes


def prompt(blocks: int) -> Reserve:
    return Reserve("", 1, 0, tuple(range(blocks)), isl_tokens=blocks * 16)


def test_scopes_share_one_byte_budget_and_the_storing_scope_evicts_its_oldest() -> None:
    one = entry_bytes("a0", prompt(1000))
    budget = SelectionCacheBudget(max_bytes=3 * one)
    first, second = PendingSelections(budget=budget), PendingSelections(budget=budget)
    first.put("a0", prompt(1000), now=0)
    first.put("a1", prompt(1000), now=0)
    second.put("b0", prompt(1000), now=0)
    assert budget.used == 3 * one
    first.put("a2", prompt(1000), now=0)  # over budget: the storing scope gives up its oldest
    assert budget.used <= budget.max_bytes
    assert first.take("a0", now=1) is None
    assert first.take("a2", now=1) is not None and second.take("b0", now=1) is not None
    assert budget.used == one  # a1 is left; taken entries gave their bytes back


def test_an_entry_bigger_than_the_whole_budget_is_not_kept_and_nothing_else_is_lost() -> None:
    budget = SelectionCacheBudget(max_bytes=entry_bytes("small", prompt(10)) * 2)
    cache = PendingSelections(budget=budget)
    cache.put("small", prompt(10), now=0)
    cache.put("huge", prompt(1_000_000), now=0)
    assert cache.take("huge", now=1) is None
    assert cache.take("small", now=1) is not None
    assert budget.used == 0


def test_replacing_and_giving_back_keep_the_count_exact() -> None:
    budget = SelectionCacheBudget()
    cache = PendingSelections(budget=budget)
    cache.put("s", prompt(5), now=0)
    cache.put("s", prompt(50), now=0)  # latest wins
    assert budget.used == entry_bytes("s", prompt(50))
    taken = cache.take("s", now=1)
    assert taken is not None and budget.used == 0
    cache.give_back("s", taken, stored_at=0)
    cache.give_back("s", taken, stored_at=0)  # once only
    assert budget.used == entry_bytes("s", prompt(50)) and len(cache) == 1
