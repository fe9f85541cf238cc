"""Placement: where each node runs. A fact of its own, beside the graph, never in the plan."""

from __future__ import annotations

from .device import Device


class Placement:
    """`id → Device` for placed nodes. Unplaced means "wherever it already is"."""

    __slots__ = ("_devices",)

    def __init__(self, devices: dict | None = None):
        self._devices: dict[str, Device] = dict(devices or {})

    def of(self, node_id: str) -> Device | None:
        return self._devices.get(node_id)

    def set(self, node_id: str, device: Device | None) -> None:
        if device is None:
            self._devices.pop(node_id, None)
        else:
            self._devices[node_id] = device

