"""One way to configure a component: its `Config` object, or the object's fields as keywords.

`Engine(config=EngineConfig(num_workers=2))` and `Engine(num_workers=2)` build the same engine;
passing both is refused, naming the field, so no keyword is silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

C = TypeVar("C")


def resolve_config(owner: str, config_type: type[C], config: C | None,
                   options: Mapping[str, Any]) -> C:
    """`config`, or a `config_type` built from `options` (validated by its `__post_init__`).

    Raises:
        TypeError: `config` is not a `config_type`, or both `config` and `options` were given.
    """
    name = config_type.__name__
    if config is None:
        return config_type(**options)
    if not isinstance(config, config_type):
        raise TypeError(f"{owner} config: expected {name}, found {type(config).__name__}")
    if options:
        field = next(iter(options))
        raise TypeError(f"{owner} {field}: expected config= or {name} fields as keywords, found "
                        f"both; pass {name}(..., {field}=...) as config, or only keywords")
    return config
