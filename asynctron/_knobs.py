"""Every environment variable asynctron reads, in one place: each read when the component it
configures is built, checked, and logged when set.

- `ASYNCTRON_STORE_DEADLINE_S`: the default `deadline_s` of object-store clients (how long an
  operation waits while the store answers none of its requests), where the code sets none.
- `ASYNCTRON_STORE_JOB_REQUESTS`: the default `job_max_requests` of object-store clients (the
  requests the whole job keeps in flight at one store; each process takes its share).
- `ASYNCTRON_RANKS_PER_NODE`: how many consecutive ranks share a node (its local checkpoint
  tier), over torchrun's `LOCAL_WORLD_SIZE`: several "nodes" on one machine, for tests and
  benchmarks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

STORE_DEADLINE_S = "ASYNCTRON_STORE_DEADLINE_S"
DEFAULT_STORE_DEADLINE_S = 60.0


def store_deadline_s() -> float:
    """`ASYNCTRON_STORE_DEADLINE_S` if set, else 60 s.

    Raises:
        ValueError: the variable is not a number of seconds > 0 (naming it and its value).
    """
    value = _positive(STORE_DEADLINE_S, float, "a number of seconds > 0")
    if value is None:
        return DEFAULT_STORE_DEADLINE_S
    logger.info("%s=%g: object-store operations fail after %g s without an answer",
                STORE_DEADLINE_S, value, value)
    return value


_deadline_flag_now: str | None = None
"""The command-line flag that sets the store deadline, while one does (`store_deadline_flag`)."""


@contextlib.contextmanager
def store_deadline_flag(flag: str, deadline_s: float | None) -> Iterator[None]:
    """For the body: a command line's `flag` sets the store deadline (to `deadline_s`, through
    `ASYNCTRON_STORE_DEADLINE_S`; None: the flag was not given), so stores opened in it take
    that deadline, and errors tell to raise `flag` instead of a config field. Both are undone
    on exit (the `asynctron` command runs in-process in tests)."""
    global _deadline_flag_now
    before = (_deadline_flag_now, os.environ.get(STORE_DEADLINE_S))
    _deadline_flag_now = flag
    if deadline_s is not None:
        os.environ[STORE_DEADLINE_S] = repr(deadline_s)
    try:
        yield
    finally:
        _deadline_flag_now = before[0]
        if before[1] is None:
            os.environ.pop(STORE_DEADLINE_S, None)
        else:
            os.environ[STORE_DEADLINE_S] = before[1]


def store_deadline_hint(config_hint: str) -> str:
    """How to make a store wait longer, as errors say it: `config_hint` (the config field and
    `ASYNCTRON_STORE_DEADLINE_S`), or the command line's flag while one sets the deadline."""
    if _deadline_flag_now is None:
        return config_hint
    return f"pass a larger {_deadline_flag_now} to wait longer"


STORE_JOB_REQUESTS = "ASYNCTRON_STORE_JOB_REQUESTS"


def store_job_requests() -> int | None:
    """`ASYNCTRON_STORE_JOB_REQUESTS` if set, else None (no job-wide bound).

    Raises:
        ValueError: the variable is not an int >= 1 (naming it and its value).
    """
    value = _int_at_least_1(STORE_JOB_REQUESTS, "requests in flight for the whole job")
    if value is None:
        return None
    logger.info("%s=%d: the job keeps at most %d requests in flight at a store", STORE_JOB_REQUESTS,
                value, value)
    return value


RANKS_PER_NODE = "ASYNCTRON_RANKS_PER_NODE"


def ranks_per_node(world_size: int) -> tuple[int, bool]:
    """How many consecutive ranks share a node: `ASYNCTRON_RANKS_PER_NODE`, else torchrun's
    `LOCAL_WORLD_SIZE`, else every rank (one node); and whether the override set it.

    Raises:
        ValueError: a variable that is not an int >= 1 (naming it and its value).
    """
    for name in (RANKS_PER_NODE, "LOCAL_WORLD_SIZE"):
        value = _int_at_least_1(name, "ranks per node")
        if value is None:
            continue
        if name == RANKS_PER_NODE:
            logger.info("%s=%d: every %d consecutive ranks are one node", name, value, value)
        return value, name == RANKS_PER_NODE
    return world_size, False


def _int_at_least_1(name: str, meaning: str) -> int | None:
    """The environment variable `name` as an int >= 1 (`meaning`: what it counts), or None
    where it is unset or blank.

    Raises:
        ValueError: it is set to anything else (naming it and its value).
    """
    value = _positive(name, int, f"an int >= 1 ({meaning})")
    return None if value is None else int(value)


def _positive(name: str, parse: Callable[[str], float], expected: str) -> float | None:
    """The environment variable `name` as `parse` reads it, if a finite number > 0; None where
    it is unset or blank.

    Raises:
        ValueError: it is set to anything else (naming it, its value and `expected`).
    """
    text = os.environ.get(name)
    if text is None or not text.strip():
        return None
    try:
        value = parse(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected {expected}, found {text!r}; fix or unset it")
    return value
