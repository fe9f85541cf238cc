"""A map's pending inputs: the indices started and not finished, one byte each (MapLoop.pending).

A map starts its inputs in increasing order of index and they finish in any order, often a chunk's run of
consecutive ones at once. A set paid a hash, an insert and a delete for every input of such a run (a tenth
of a tiny map's host time, measured in issue 31); here a run is a slice of a bytearray, set or cleared at C
speed, and only the stretch from the oldest pending index on is kept (`low`: the index of byte 0): a byte for
every input started since the oldest one still pending (an unordered map that goes on past an input that never
ends keeps a byte per input started since: 1 MiB a million).
"""

from __future__ import annotations

KEEP = 4096  # the finished stretch before the oldest pending index is cut off once it is this long (and half)


class Pending:
    """Indices started and not finished. `add` takes indices above every index added before."""

    __slots__ = ("bits", "low", "head", "count", "keep")

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self.bits = bytearray()  # bits[i] == 1: index low + i is pending
        self.low = 0
        self.head = 0  # bits[:head] are all 0 (the oldest pending index is at head or above)
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def __contains__(self, index: int) -> bool:
        at = index - self.low
        return 0 <= at < len(self.bits) and self.bits[at] == 1

    def add(self, indices: list) -> None:
        """These indices (ascending, each above every index added before) are pending."""
        if not indices:
            return
        bits, first = self.bits, indices[0]
        if not bits and not self.count:
            self.low, self.head = first, 0  # (nothing kept: start at the first of these)
        top = self.low + len(bits)
        if first < top:
            raise ValueError(f"index {first} added below an index added before ({top - 1})")
        if first > top:
            bits.extend(bytes(first - top))  # (a gap: indices a resumed map does not run)
        if indices[-1] - first == len(indices) - 1:  # (consecutive: the common case, one slice)
            bits.extend(b"\x01" * len(indices))
        else:
            for index in indices:
                at = index - self.low
                if at > len(bits):
                    bits.extend(bytes(at - len(bits)))
                bits.append(1)
        self.count += len(indices)

    def discard(self, index: int) -> None:
        at = index - self.low
        if 0 <= at < len(self.bits) and self.bits[at]:
            self.bits[at] = 0
            self.count -= 1
            if at <= self.head:
                self._trim()

    def discard_run(self, first: int, count: int) -> None:
        """Indices `first` to `first + count - 1` are no longer pending (those that were)."""
        start, bits = max(0, first - self.low), self.bits
        stop = min(len(bits), first - self.low + count)
        if start >= stop:
            return
        self.count -= bits.count(1, start, stop)
        bits[start:stop] = bytes(stop - start)
        if start <= self.head:
            self._trim()

    def oldest(self) -> int | None:
        """The lowest pending index (None: none)."""
        if not self.count:
            return None
        return self.low + self.bits.find(1, self.head)

    def _trim(self) -> None:
        """Cut off the finished stretch in front of the oldest pending index, once it is long."""
        bits = self.bits
        if not self.count:
            self.low += len(bits)
            self.head = 0
            bits.clear()
            return
        self.head = first = bits.find(1, self.head)
        if first >= self.keep and 2 * first >= len(bits):
            del bits[:first]
            self.low += first
            self.head = 0
