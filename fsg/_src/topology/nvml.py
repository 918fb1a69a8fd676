"""NVLink domains from NVML: which GPUs of a node reach each other over NVLink.

``links_of(bus_id)`` asks NVML (``libnvidia-ml.so.1``, loaded with ``ctypes``: no Python
package needed) for one GPU's active NVLinks: whether they lead to an NVSwitch and which GPUs
they reach directly. ``nvlink_domains`` turns every rank's answer, gathered by
``Topology.from_job``, into a label per rank: GPUs of one host joined by NVLink (through a
switch, or a chain of direct links) share a domain; a GPU without NVLink is a domain of its own.

NVML calls used (all in the NVML API since CUDA 11): ``nvmlInit_v2``,
``nvmlDeviceGetHandleByPciBusId_v2``, ``nvmlDeviceGetNvLinkState``,
``nvmlDeviceGetNvLinkRemotePciInfo_v2``, ``nvmlDeviceGetNvLinkRemoteDeviceType``.
Multi-node NVLink (GB200 NVL72: ``nvmlDeviceGetGpuFabricInfo``) is not read: a domain here lies
inside a host.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import re
from collections.abc import Sequence
from typing import NamedTuple

import torch

log = logging.getLogger("fsg")

MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS
_SUCCESS = 0
_ENABLED = 1
_DEVICE_TYPE_SWITCH = 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH
_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-9a-fA-F])$")


class _PciInfo(ctypes.Structure):  # nvmlPciInfo_t
    _fields_ = [
        ("busIdLegacy", ctypes.c_char * 16),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),
    ]


class Links(NamedTuple):
    """One GPU's NVLinks as NVML reports them.

    Attributes:
      bus_id: the GPU's PCI bus id, normalized (``"00000000:19:00.0"``).
      active: how many of its NVLinks are up.
      switches: bus ids of the NVSwitches its active links lead to (``"?"`` for one NVML
        gives no PCI address for); every GPU on a switch reaches every other.
      peers: bus ids of the GPUs its active links reach directly (no switch between).
    """

    bus_id: str
    active: int
    switches: tuple[str, ...]
    peers: tuple[str, ...]


def normalize_bus_id(bus_id: str) -> str:
    """``"0000:19:00.0"``, ``"00000000:19:00.0"`` or ``"19:00.0"`` as ``"00000000:19:00.0"``."""
    match = _BUS_ID.match(bus_id.strip())
    if match is None:
        raise ValueError(f"{bus_id!r} is not a PCI bus id (domain:bus:device.function, e.g. 00000000:19:00.0)")
    domain, bus, device, function = (int(g or "0", 16) for g in match.groups())
    return f"{domain:08x}:{bus:02x}:{device:02x}.{function:x}"


def cuda_bus_id(device: torch.device | int | None = None) -> str | None:
    """The PCI bus id of a CUDA device (default: the current one), ``None`` without CUDA."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    return f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    code = lib.nvmlInit_v2()
    if code != _SUCCESS:
        log.info("fsg: NVML did not initialize (error %d); no NVLink domains are discovered", code)
        return None
    return lib


def links_of(bus_id: str | None) -> Links | None:
    """``bus_id``'s NVLinks, or ``None`` when NVML is absent or does not know the GPU."""
    lib = _library()
    if lib is None or bus_id is None:
        return None
    bus_id = normalize_bus_id(bus_id)
    handle = ctypes.c_void_p()
    if lib.nvmlDeviceGetHandleByPciBusId_v2(bus_id.upper().encode(), ctypes.byref(handle)) != _SUCCESS:
        return None
    active, switches, peers = 0, [], []
    for link in range(MAX_LINKS):
        state = ctypes.c_int()
        if lib.nvmlDeviceGetNvLinkState(handle, ctypes.c_uint(link), ctypes.byref(state)) != _SUCCESS:
            continue  # past the GPU's last link, or NVLink not supported
        if state.value != _ENABLED:
            continue
        active += 1
        kind = ctypes.c_int(-1)
        lib.nvmlDeviceGetNvLinkRemoteDeviceType(handle, ctypes.c_uint(link), ctypes.byref(kind))
        pci = _PciInfo()
        remote = None
        if lib.nvmlDeviceGetNvLinkRemotePciInfo_v2(handle, ctypes.c_uint(link), ctypes.byref(pci)) == _SUCCESS:
            try:
                remote = normalize_bus_id(pci.busId.decode())
            except ValueError:
                remote = None
        if kind.value == _DEVICE_TYPE_SWITCH:
            switches.append(remote or "?")
        elif remote is not None:
            peers.append(remote)
    return Links(bus_id, active, tuple(sorted(set(switches))), tuple(sorted(set(peers))))


def nvlink_domains(hostnames: Sequence[str], links: Sequence[Links | None]) -> list[str] | None:
    """Per rank, the label of its NVLink domain inside its host; ``None`` if a rank has no
    NVML answer (then nothing is known below the node).

    GPUs of one host on a common NVSwitch share a domain; so do GPUs joined by direct links,
    directly or through other GPUs of the host. Ranks that share a GPU share its domain.

    Example:
      >>> a, b = "00000000:01:00.0", "00000000:02:00.0"
      >>> nvlink_domains(["h", "h", "h"], [Links(a, 4, (), (b,)), Links(b, 4, (), (a,)),
      ...                                  Links("00000000:03:00.0", 0, (), ())])
      ['nvl0', 'nvl0', 'nvl1']
    """
    if len(links) != len(hostnames):
        raise ValueError(f"{len(links)} NVLink answers for {len(hostnames)} ranks")
    if any(record is None for record in links):
        return None
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def find(key):
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    def union(a, b):
        parent[find(a)] = find(b)

    for host, record in zip(hostnames, links):
        parent.setdefault((host, record.bus_id), (host, record.bus_id))
    on_switch: dict[tuple[str, str], tuple[str, str]] = {}
    for host, record in zip(hostnames, links):
        me = (host, record.bus_id)
        for switch in record.switches:
            union(me, on_switch.setdefault((host, switch), me))
        for peer in record.peers:
            if (host, peer) in parent:
                union(me, (host, peer))
    labels: dict[tuple[str, str], str] = {}
    per_host: dict[str, int] = {}
    out = []
    for host, record in zip(hostnames, links):
        root = find((host, record.bus_id))
        if root not in labels:
            labels[root] = f"nvl{per_host.get(host, 0)}"
            per_host[host] = per_host.get(host, 0) + 1
        out.append(labels[root])
    return out
