"""Every environment variable asynctron reads, in one place: each read when the component it
configures is built, checked, and logged when set.

- `ASYNCTRON_STORE_DEADLINE_S`: the default `deadline_s` of object-store clients (how long an
  operation waits while the store answers none of its requests), where the code sets none.
"""

from __future__ import annotations

import logging
import math
import os

logger = logging.getLogger(__name__)

STORE_DEADLINE_S = "ASYNCTRON_STORE_DEADLINE_S"
DEFAULT_STORE_DEADLINE_S = 60.0


def store_deadline_s() -> float:
    """`ASYNCTRON_STORE_DEADLINE_S` if set, else 60 s.

    Raises:
        ValueError: the variable is not a number of seconds > 0 (naming it and its value).
    """
    text = os.environ.get(STORE_DEADLINE_S)
    if text is None or not text.strip():
        return DEFAULT_STORE_DEADLINE_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{STORE_DEADLINE_S}: expected a number of seconds > 0, found "
                         f"{text!r}; fix or unset it")
    logger.info("%s=%g: object-store operations fail after %g s without an answer",
                STORE_DEADLINE_S, value, value)
    return value
