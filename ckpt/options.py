"""The Checkpointer's options, checked when it is made: a wrong one fails the constructor
saying what was wrong, never the first save (with interval="auto", minutes into the run)."""

from __future__ import annotations

import json
import math
import numbers
from typing import Any, Literal

from ckpt.schedule.policy import Auto, Every, Keep
from ckpt.storage.lease import Lease

Restore = Literal["latest", "none"] | int
OnError = Literal["raise", "log"] | int


def checked_interval(interval: Any) -> Every | Auto | None:
    """The interval as the Checkpointer keeps it ("auto" becomes ``Auto()``)."""
    if interval == "auto":
        return Auto()
    if not (interval is None or isinstance(interval, (Every, Auto))):
        raise ValueError(f"interval must be 'auto', ckpt.Auto(...), ckpt.Every(...) or None, not {interval!r}")
    return interval


def check_restore(restore: Any) -> None:
    if not (restore in ("latest", "none") or (isinstance(restore, int) and not isinstance(restore, bool) and restore >= 0)):
        raise ValueError(f"restore must be 'latest', 'none' or a step number, not {restore!r}")


def check_options(
    *,
    on_error: Any,
    restore: Any,
    keep: Any,
    if_busy: Any,
    lease: Any,
    metadata: Any,
    timeout_s: Any,
    budget: Any,
    agree_every_s: Any,
    frozen: Any = "save",
) -> None:
    if not (on_error in ("raise", "log") or (type(on_error) is int and on_error >= 1)):
        raise ValueError(f"on_error must be 'raise', 'log' or a number of failed saves in a row (>= 1), not {on_error!r}")
    check_restore(restore)
    if not isinstance(keep, Keep):
        raise ValueError(f"keep must be ckpt.Keep(last=..., every_steps=...), not {keep!r}")
    if frozen not in ("save", "skip"):
        raise ValueError(f"frozen must be 'save' (frozen parameters in every checkpoint) or 'skip' (never saved nor loaded), not {frozen!r}")
    if if_busy not in ("wait", "skip"):
        raise ValueError(f"if_busy must be 'wait' or 'skip', not {if_busy!r}")
    if not (lease is None or isinstance(lease, Lease)):
        raise ValueError(f"lease must be a ckpt.Lease(...) or None, not {lease!r}")
    for name, value in (("timeout_s", timeout_s), ("agree_every_s", agree_every_s)):
        check_seconds(name, value)
    if budget is not None and not _positive(budget):
        raise ValueError(f"host_memory_budget must be a positive number of bytes (or None: the default), not {budget!r}")
    try:
        json.dumps(dict(metadata or {}))
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata goes into every manifest, as JSON: {e}") from None


def check_seconds(name: str, value: Any) -> None:
    if not _positive(value):
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 < value < math.inf


class Counters(dict):  # type: ignore[type-arg]
    """The user's counters (``cp.counters``): JSON values under string keys, checked when set,
    so that a wrong one fails where it is set, not at the next save (minutes later with
    interval="auto"). "step" is ckpt's own (``cp.step``)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        _check_counter(key, value)
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        new = dict(*args, **kwargs)
        check_counters(new)  # all or nothing
        super().update(new)

    def __ior__(self, other: Any) -> Counters:  # type: ignore[override]
        self.update(other)
        return self

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]


def check_counters(counters: Any) -> None:
    """Before a save changes anything: ``cp.counters`` as a save can write and a restore give
    back (a plain dict assigned to it is checked here)."""
    if not isinstance(counters, dict):
        raise TypeError(f"cp.counters must be a dict of JSON values, not {type(counters).__name__}")
    for key, value in counters.items():
        _check_counter(key, value)


def _check_counter(key: Any, value: Any) -> None:
    if not isinstance(key, str):
        raise TypeError(f"a counter's name is a string (it is saved as JSON), not {key!r}")
    if key == "step":
        raise ValueError("cp.counters['step'] is ckpt's own (cp.step, the steps completed): name the counter otherwise")
    bad = _not_json(value)
    if bad is not None:
        raise TypeError(
            f"counter {key!r} holds {bad}: counters are saved as JSON (numbers, strings, booleans, "
            "None, lists or tuples, and dicts with string keys) and come back as such (a tuple as a list)"
        )


def _not_json(value: Any) -> str | None:
    """What in `value` would not come back from JSON as it is (None: all of it would)."""
    if value is None or isinstance(value, (str, int, float)):
        return None
    if type(value) in (list, tuple):  # a tuple comes back as a list, which unpacks the same
        return next((b for b in map(_not_json, value) if b is not None), None)
    if type(value) is dict:
        for k, v in value.items():
            if not isinstance(k, str):
                return f"a dict key {k!r} (it would come back as a string)"
            if (b := _not_json(v)) is not None:
                return b
        return None
    return f"a {type(value).__name__} ({repr(value)[:60]})"
