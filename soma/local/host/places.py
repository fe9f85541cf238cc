"""A set of places in one chunk (0 to its count - 1), one byte each: a Chunk's `open` and its Job's `pending`.

A chunk's answer comes in parts of consecutive places; a set paid a hash and a delete for each input of a part,
and two subset checks before (a fifth of a tiny map's host time, measured in issue 31). Here a run of places is
checked and cleared as one slice of a bytearray, at C speed; single places (a failure, a cancel, a give-back)
go one by one as before.
"""

from __future__ import annotations


class Places:
    """Places of one chunk; iterates in ascending order."""

    __slots__ = ("bits",)

    def __init__(self, size: int, places=None):
        """All places 0 to `size - 1`, or only `places` (each below `size`)."""
        if places is None:
            self.bits = bytearray(b"\x01" * size)
        else:
            self.bits = bytearray(size)
            for place in places:
                self.bits[place] = 1

    def __len__(self) -> int:
        return self.bits.count(1)

    def __bool__(self) -> bool:
        return 1 in self.bits

    def __contains__(self, place: int) -> bool:
        return 0 <= place < len(self.bits) and self.bits[place] == 1

    def __iter__(self):
        bits = self.bits
        return (place for place in range(len(bits)) if bits[place])

    def __repr__(self) -> str:
        return f"Places({list(self)})"

    def covers(self, start: int, stop: int) -> bool:
        """Whether every place from `start` to `stop - 1` is here."""
        return 0 <= start <= stop <= len(self.bits) and self.bits.find(0, start, stop) < 0

    def drop_run(self, start: int, stop: int) -> None:
        """Places `start` to `stop - 1` are no longer here."""
        self.bits[start:stop] = bytes(stop - start)

    def discard(self, place: int) -> None:
        if 0 <= place < len(self.bits):
            self.bits[place] = 0

    def difference_update(self, places) -> None:
        for place in places:
            self.discard(place)

    def clear(self) -> None:
        self.bits[:] = bytes(len(self.bits))
