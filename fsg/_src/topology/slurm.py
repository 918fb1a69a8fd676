"""Reading a Slurm ``topology.conf`` (``topology/tree``): leaf switches are racks.

    SwitchName=leaf0 Nodes=gpu[000-031]
    SwitchName=leaf1 Nodes=gpu[032-063]
    SwitchName=spine0 Switches=leaf[0-1]

A switch with ``Nodes=`` is a rack; when switches stand between a leaf and the root, the one
just below the root is the leaf's pod. Node names use Slurm's hostlist syntax
(``gpu[000-031,040]``).
"""

from __future__ import annotations

import re

from fsg._src.errors import TopologyError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str, where: str) -> list[str]:
    """``"gpu[00-02,07],login"`` -> ``["gpu00", "gpu01", "gpu02", "gpu07", "login"]``."""
    out, depth, start = [], 0, 0
    items = []
    for i, ch in enumerate(text + ","):
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise TopologyError(f"{where}: unbalanced brackets in hostlist {text!r}")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise TopologyError(f"{where}: unbalanced brackets in hostlist {text!r}")
    for item in items:
        if not item:
            continue
        m = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\]([^\[\]]*)", item)
        if not m:
            if "[" in item or "]" in item:
                raise TopologyError(f"{where}: cannot read hostlist item {item!r}; write e.g. gpu[000-031]")
            out.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            rm = _RANGE.match(r)
            if not rm or (rm.group(2) and int(rm.group(2)) < int(rm.group(1))):
                raise TopologyError(f"{where}: bad range {r!r} in hostlist {item!r}; write lo-hi with lo <= hi")
            lo, hi = rm.group(1), rm.group(2) or rm.group(1)
            width = len(lo) if lo.startswith("0") else 0
            out += [f"{prefix}{n:0{width}d}{suffix}" for n in range(int(lo), int(hi) + 1)]
    return out


def parse(text: str, where: str) -> tuple[list[str], dict[str, str], dict[str, str] | None]:
    """``(hosts in file order, {host: rack}, {rack: pod} or None)`` from a topology.conf text."""
    nodes_of: dict[str, list[str]] = {}
    parent: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        bad = [f for f in line.split() if "=" not in f]
        unknown = [k for k in fields if k not in ("SwitchName", "Nodes", "Switches", "LinkSpeed")]
        if bad or unknown or "SwitchName" not in fields:
            what = repr((bad + unknown)[0]) if bad + unknown else "no SwitchName"
            raise TopologyError(
                f"{where}:{lineno}: cannot read {raw.strip()!r} ({what}); lines are "
                f"'SwitchName=<name> Nodes=<hostlist>' or 'SwitchName=<name> Switches=<list>'"
            )
        name = fields["SwitchName"]
        if "Nodes" in fields:
            nodes_of[name] = expand_hostlist(fields["Nodes"], f"{where}:{lineno}")
        for child in expand_hostlist(fields.get("Switches", ""), f"{where}:{lineno}"):
            parent[child] = name
    if not nodes_of:
        raise TopologyError(f"{where}: no switch lists Nodes=; a topology.conf needs leaf switches with nodes")
    hosts, rack_of = [], {}
    for leaf, hosts_here in nodes_of.items():
        for host in hosts_here:
            if host in rack_of:
                raise TopologyError(f"{where}: node {host!r} is under two leaf switches ({rack_of[host]!r}, {leaf!r})")
            rack_of[host] = leaf
            hosts.append(host)
    pod_of = {}
    for leaf in nodes_of:
        path = [leaf]
        while path[-1] in parent:
            path.append(parent[path[-1]])
            if len(path) > len(parent) + 1:
                raise TopologyError(f"{where}: switches form a cycle through {leaf!r}")
        if len(path) >= 3:
            pod_of[leaf] = path[-2]
    if pod_of and len(pod_of) != len(nodes_of):
        pod_of.update({leaf: leaf for leaf in nodes_of if leaf not in pod_of})
    return hosts, rack_of, pod_of or None
