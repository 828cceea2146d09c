"""A chat template's bounds: a model directory's template is code from whoever wrote the directory, run per request.

jinja2's immutable sandbox already refuses unsafe attributes and mutation; it does not bound work or memory. A
template could loop for hours (``range`` nested in ``range``: each within jinja2's own ``MAX_RANGE``), build a
string of gigabytes (``'x' * 10**10``, ``'x'|center(10**10)``) or make the compiler do so at startup (jinja2
folds constant expressions when it compiles). So, on top of the sandbox:

* a render has a deadline (``RENDER_SECONDS``) and a step budget (``RENDER_STEPS``): each loop iteration over
  ``range`` or over the request's lists, each attribute or item read and each call counts, and passing either refuses
  the request;
* numbers given to filters and functions, and the repeat counts of ``*``, are bounded (``MAX_NUMBER``), and ``*``,
  ``**`` and ``%`` are done at render time (never folded at compile time) with their results bounded
  (``MAX_VALUE_CHARS``, ``MAX_POWER_BITS``);
* ``lipsum`` (a generator of paragraphs) is not offered.

A refusal is ``TemplateBudgetExceeded``; the caller answers 400.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

RENDER_SECONDS = 2.0
RENDER_STEPS = 2_000_000
MAX_NUMBER = 1_000_000
MAX_VALUE_CHARS = 16 * 1024 * 1024
MAX_POWER_BITS = 4096


class TemplateBudgetExceeded(ValueError):
    """The template went past one of its bounds; ``str`` is one line for the 400 answer."""


class _Budget(threading.local):
    """The current render's deadline and steps left, per thread (renders run on the tokenizer threads)."""

    deadline = 0.0
    steps = 0


_budget = _Budget()


def start_render() -> None:
    _budget.deadline = time.monotonic() + RENDER_SECONDS
    _budget.steps = RENDER_STEPS


def tick() -> None:
    """One step of the current render."""
    _budget.steps -= 1
    if _budget.steps < 0:
        raise TemplateBudgetExceeded(f"the model's chat template took more than {RENDER_STEPS} steps")
    if _budget.steps % 1024 == 0 and time.monotonic() > _budget.deadline:
        raise TemplateBudgetExceeded(f"the model's chat template took more than {RENDER_SECONDS:g} s to render")


class BudgetedList(list[Any]):
    """A request's list (``messages``, content parts, ``tools``) whose iteration counts against the budget."""

    def __iter__(self) -> Iterator[Any]:
        for item in super().__iter__():
            tick()
            yield item


def budgeted(value: Any) -> Any:
    """``value`` (parsed JSON) with every list a ``BudgetedList``."""
    if isinstance(value, list):
        return BudgetedList(budgeted(item) for item in value)
    if isinstance(value, dict):
        return {key: budgeted(item) for key, item in value.items()}
    return value


def _checked_number(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_NUMBER:
        raise TemplateBudgetExceeded(
            f"the model's chat template used the number {_short(value)} (at most {MAX_NUMBER})"
        )
    return value


def _short(value: int) -> str:
    return str(value) if value.bit_length() < 64 else f"of {value.bit_length()} bits"


def _bounded_range(*args: Any) -> Iterator[int]:
    for arg in args:
        _checked_number(arg)
    for value in range(*args):
        tick()
        yield value


def bounded_callable(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with its numeric arguments bounded (filters: ``center``, ``indent``, ``truncate``, ...)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        for arg in (*args, *kwargs.values()):
            _checked_number(arg)
        return function(*args, **kwargs)

    mark = getattr(function, "jinja_pass_arg", None)  # jinja2's pass_context / pass_environment mark
    if mark is not None:
        call.jinja_pass_arg = mark  # type: ignore[attr-defined]
    call.__name__ = getattr(function, "__name__", "filter")
    return call


def _binop(operator: str, left: Any, right: Any) -> Any:
    """``*``, ``**`` and ``%`` with their results bounded before they are built."""
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            repeated = isinstance(sequence, str | list | tuple) and isinstance(count, int)
            if repeated and len(sequence) * max(count, 0) > MAX_VALUE_CHARS:
                raise TemplateBudgetExceeded(
                    f"the model's chat template repeated a value past {MAX_VALUE_CHARS} characters"
                )
        return left * right
    if operator == "**":
        integers = isinstance(left, int) and isinstance(right, int) and right > 0
        if integers and max(left.bit_length(), 1) * right > MAX_POWER_BITS:
            raise TemplateBudgetExceeded(f"the model's chat template raised a number past {MAX_POWER_BITS} bits")
        return left**right
    if isinstance(left, str):
        result = left % right
        if len(result) > MAX_VALUE_CHARS:
            raise TemplateBudgetExceeded(f"the model's chat template formatted past {MAX_VALUE_CHARS} characters")
        return result
    return left % right


def make_environment(**options: Any) -> Any:
    """jinja2's immutable sandbox with the bounds above (imported here: jinja2 is an optional dependency)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            tick()
            return _binop(operator, left, right)

        def getattr(self, obj: Any, attribute: str) -> Any:
            tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            tick()
            return super().getitem(obj, argument)

        def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            tick()
            for arg in (*args, *kwargs.values()):
                _checked_number(arg)
            return super().call(__context, __obj, *args, **kwargs)

    environment = BoundedSandbox(**options)
    environment.globals.pop("lipsum", None)
    environment.globals["range"] = _bounded_range
    for name, function in list(environment.filters.items()):
        environment.filters[name] = bounded_callable(function)
    return environment
