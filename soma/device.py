"""Devices: the one place where device strings are parsed.

A `Device` is `cpu`, `cuda:N` or `meta`, written the way torch writes it, so
`str(device)` can be handed to `.to()` untranslated. The cuda index is
mandatory: bare `cuda` means "the current GPU" in torch, which is thread state,
not a placement. Everything else in soma carries a `Device` or its string;
nothing else parses.
"""

from __future__ import annotations

import re

from .errors import DeviceError

_EXPECTED = "expected cpu, cuda:N or meta"
_SHAPE = re.compile(r"^([A-Za-z_]+)(?::(\d+))?$")
_INDEXLESS = {"cpu", "meta"}


class Device:
    """Where a node runs: `Device("cpu")`, `Device("cuda", 0)`, `Device("meta")`. Immutable."""

    __slots__ = ("kind", "index")

    def __init__(self, kind: str, index: int | None = None):
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "index", index)

    def __setattr__(self, name, value):
        raise AttributeError("Device is immutable")

    def __eq__(self, other):
        return type(other) is Device and (other.kind, other.index) == (self.kind, self.index)

    def __hash__(self):
        return hash((self.kind, self.index))

    def __reduce__(self):
        return (Device, (self.kind, self.index))

    @classmethod
    def parse(cls, text) -> "Device":
        """Parse `cpu`, `meta` or `cuda:N`; anything else is a `DeviceError` saying why."""
        if isinstance(text, Device):
            return text
        if not isinstance(text, str):
            if type(text).__name__ == "device" and type(text).__module__ == "torch":
                text = str(text)  # a torch.device: same spelling as ours
            else:
                raise DeviceError(
                    f"a device is a string like `cpu`, `cuda:0` or `meta`, not {type(text).__name__} {text!r}"
                )
        match = _SHAPE.match(text)
        if match is None:
            raise DeviceError(f"not shaped like a device: `{text}` ({_EXPECTED})")
        kind, index = match.group(1), match.group(2)
        if kind == "cuda":
            if index is None:
                raise DeviceError("`cuda` needs an index, write `cuda:0`")
            return cls("cuda", int(index))
        if kind in _INDEXLESS:
            if index is not None:
                raise DeviceError(f"not shaped like a device: `{text}` ({kind} takes no index; {_EXPECTED})")
            return cls(kind)
        raise DeviceError(f"unknown kind `{kind}` ({_EXPECTED})")

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    def __repr__(self) -> str:
        return f"Device({str(self)!r})"
