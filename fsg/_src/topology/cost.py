"""An alpha-beta model of collective time, per collective kind and per link level.

    t(kind, n, S, level) = floor[kind] + hops(kind, n) * latency[level]
                           + factor(kind, n) * S / min(busbw[kind], bandwidth[level])

``S`` is the full buffer (all-reduce buffer, all-gather output, reduce-scatter input).
``factor`` is nccl-tests' bus-bandwidth factor: ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for
the others. ``hops`` is a ring's ``n-1`` steps (an all-reduce's ``2(n-1)``, or
``2 ceil(log2 n)`` when a tree is shorter, as NCCL picks for large groups).

The defaults take the issue's measurements on two H200s at their ends: floors of 33-95 us and
peak bus bandwidth 277-335 GB/s "depending on the collective". Which kind had which end was
not recorded, so the all-reduce and all-to-all get the slow end and the all-gather and
reduce-scatter the fast one until ``benchmarks/collectives.py`` writes a calibration
(``CostModel.load``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from fsg._src.errors import TopologyError
from fsg._src.topology.levels import Link

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
# aten / c10d_functional names -> kind
_ALIASES = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
    "send_recv": "send_recv", "send": "send_recv", "recv": "send_recv", "isend": "send_recv", "irecv": "send_recv",
}  # fmt: skip


class KindCost(NamedTuple):
    """One collective kind's fixed floor (us, the time of a tiny message on two GPUs) and peak
    bus bandwidth (GB/s, what its kernel reaches at large messages)."""

    floor_us: float
    busbw_GBps: float


DEFAULT_KINDS = {
    "all_reduce": KindCost(95.0, 277.0),
    "all_gather": KindCost(33.0, 335.0),
    "reduce_scatter": KindCost(33.0, 335.0),
    "all_to_all": KindCost(95.0, 277.0),
    # a pipeline's point-to-point message: not measured; the all-gather's figures until calibrated
    "send_recv": KindCost(33.0, 335.0),
}


def kind_of(name: str) -> str:
    """The kind (``"all_gather"``...) of a collective op name (``"all_gather_into_tensor"``)."""
    kind = _ALIASES.get(str(name).split(".")[-1])
    if kind is None:
        raise TopologyError(f"collective kind {name!r} has no cost model; known: {sorted(_ALIASES)}")
    return kind


def bus_factor(kind: str, n: int) -> float:
    if kind == "send_recv":  # one message to the neighbouring stage: its bytes once
        return 1.0
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n


def hops(kind: str, n: int) -> int:
    if kind == "send_recv":
        return 1
    if kind == "all_reduce":
        return min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
    return n - 1


class CostModel:
    """Predicted collective times: ``floor + hops * latency + factor * S / bandwidth``.

    Args:
      kinds: ``{kind: KindCost}``; default ``DEFAULT_KINDS`` (the issue's H200 figures).

    Example:
      >>> model = CostModel()
      >>> t = model.time("all_reduce", 2, 1 << 30, Link(335.0, 1.5))
      >>> round(t * 1e3, 2)  # ms for 1 GiB on two NVLink GPUs at 277 GB/s bus bandwidth
      3.97
    """

    def __init__(self, kinds: Mapping[str, KindCost] | None = None):
        self.kinds = dict(DEFAULT_KINDS)
        for kind, cost in (kinds or {}).items():
            if kind not in KINDS:
                raise TopologyError(f"cost model kind {kind!r} is unknown; kinds are {list(KINDS)}")
            self.kinds[kind] = KindCost(*cost)

    def time(self, kind: str, n: int, nbytes: float, link: Link) -> float:
        """Seconds for one ``kind`` collective of full buffer ``nbytes`` over ``n`` ranks whose
        widest link is ``link``."""
        if n <= 1:
            return 0.0
        cost = self.kinds[kind_of(kind)]
        bandwidth = min(cost.busbw_GBps, link.bandwidth_GBps) * 1e9
        return cost.floor_us * 1e-6 + hops(kind, n) * link.latency_us * 1e-6 + bus_factor(kind, n) * nbytes / bandwidth

    @classmethod
    def load(cls, path: str) -> CostModel:
        """A model calibrated by ``benchmarks/collectives.py`` (its JSON's ``"fit"``)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TopologyError(f"cannot read the calibration {path!r}: {exc}") from exc
        fit = data.get("fit") if isinstance(data, dict) else None
        if not isinstance(fit, dict) or not fit:
            raise TopologyError(f"{path} has no 'fit' table; write it with benchmarks/collectives.py")
        kinds = {}
        for kind, row in fit.items():
            if not (isinstance(row, dict) and {"floor_us", "busbw_GBps"} <= set(row)):
                raise TopologyError(f"{path}: fit.{kind} lacks floor_us / busbw_GBps")
            kinds[kind] = KindCost(float(row["floor_us"]), float(row["busbw_GBps"]))
        return cls(kinds)


def fit(samples: list[dict], n: int) -> dict[str, dict[str, float]]:
    """Fits ``{kind: {floor_us, busbw_GBps}}`` to ``[{kind, bytes, time_us}]`` measured on ``n``
    ranks of one node: the floor is the fastest small message (<= 64 KiB), the bus bandwidth
    the median over messages >= 64 MiB of ``factor * S / (t - floor)``."""
    out = {}
    for kind in sorted({s["kind"] for s in samples}):
        rows = [s for s in samples if s["kind"] == kind]
        small = [s["time_us"] for s in rows if s["bytes"] <= 64 << 10] or [min(s["time_us"] for s in rows)]
        floor = min(small)
        big = sorted(
            bus_factor(kind, n) * s["bytes"] / max(s["time_us"] - floor, 1e-3) * 1e-3
            for s in rows
            if s["bytes"] >= 64 << 20
        )
        busbw = big[len(big) // 2] if big else max(bus_factor(kind, n) * s["bytes"] / s["time_us"] * 1e-3 for s in rows)
        out[kind] = {"floor_us": floor, "busbw_GBps": busbw}
    return out
