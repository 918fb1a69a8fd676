"""Building a ``Topology`` from a regular description, hostnames, a parsed file or a path."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from fsg._src.errors import TopologyError
from fsg._src.topology import slurm

REGULAR_FIELDS = ("nodes", "gpus_per_node", "nodes_per_rack", "racks_per_pod", "nvlink_domain", "links")
HOSTS_FIELDS = ("hosts", "links")
HOST_FIELDS = ("name", "gpus", "rack", "pod")


def _positive(value: object, field: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TopologyError(f"{field} is {value!r}; it must be an int >= 1")
    return value


def regular(cls, nodes, gpus_per_node, nodes_per_rack, racks_per_pod, nvlink_domain, links):
    nodes = _positive(nodes, "nodes")
    gpus = _positive(gpus_per_node, "gpus_per_node")
    per_rack = _positive(nodes_per_rack, "nodes_per_rack", optional=True)
    per_pod = _positive(racks_per_pod, "racks_per_pod", optional=True)
    nvl = _positive(nvlink_domain, "nvlink_domain", optional=True)
    if per_pod is not None and per_rack is None:
        raise TopologyError("racks_per_pod is given without nodes_per_rack; pods are made of racks: give both")
    if nvl is not None and (nvl > gpus or gpus % nvl):
        raise TopologyError(
            f"nvlink_domain is {nvl} but a node has {gpus} GPUs; an NVLink domain here lies inside a node "
            f"and divides it (leave it out when the whole node is one domain)"
        )
    names = (["nvlink"] if nvl is not None and nvl < gpus else []) + ["node"]
    names += (["rack"] if per_rack else []) + (["pod"] if per_pod else []) + ["cluster"]
    locations = []
    for node in range(nodes):
        for gpu in range(gpus):
            loc = ([f"n{node}.{gpu // nvl}"] if "nvlink" in names else []) + [f"n{node}"]
            if per_rack:
                loc.append(f"r{node // per_rack}")
            if per_pod:
                loc.append(f"p{node // per_rack // per_pod}")
            locations.append(loc + ["all"])
    return cls(names, locations, links=links)


def _grouping(value, keys: list, field: str, what: str) -> dict | None:
    """``{key: group label}`` from a mapping or a count of keys per group (in order)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        missing = [k for k in keys if k not in value]
        if missing:
            raise TopologyError(f"{field} gives no {what} for {missing[:3]}; give every one a {what}")
        return {k: value[k] for k in keys}
    count = _positive(value, field)
    return {k: f"{what}{i // count}" for i, k in enumerate(keys)}


def from_hostnames(cls, hostnames, racks, pods, links, nvlink=None):
    if isinstance(hostnames, str) or not isinstance(hostnames, Sequence) or not hostnames:
        raise TopologyError(f"hostnames is {hostnames!r:.60}; give a non-empty list, one hostname per rank")
    for rank, host in enumerate(hostnames):
        if not isinstance(host, str) or not host:
            raise TopologyError(f"hostnames[{rank}] is {host!r}; a hostname is a non-empty string")
    hosts = list(dict.fromkeys(hostnames))
    rack_of = _grouping(racks, hosts, "racks", "rack")
    pod_of = _grouping(pods, list(dict.fromkeys(rack_of.values())), "pods", "pod") if rack_of and pods else None
    if pods is not None and rack_of is None:
        raise TopologyError("pods is given without racks; pods are made of racks: give both")
    if nvlink is not None and (isinstance(nvlink, str) or len(nvlink) != len(hostnames)):
        raise TopologyError(f"nvlink gives {len(nvlink)} labels for {len(hostnames)} ranks; give one per rank")
    split = nvlink is not None and len(set(zip(hostnames, nvlink))) > len(hosts)  # some node has 2+ domains
    names = (["nvlink"] if split else []) + ["node"] + (["rack"] if rack_of else []) + (["pod"] if pod_of else [])
    names.append("cluster")
    locations = []
    for rank, host in enumerate(hostnames):
        loc = ([f"{host}/{nvlink[rank]}"] if split else []) + [host]
        if rack_of:
            loc.append(rack_of[host])
            if pod_of:
                loc.append(pod_of[rack_of[host]])
        locations.append(loc + ["all"])
    return cls(names, locations, links=links)


def from_dict(cls, d):
    if not isinstance(d, Mapping):
        raise TopologyError(f"a topology description is a mapping, got {type(d).__name__}")
    fields = HOSTS_FIELDS if "hosts" in d else REGULAR_FIELDS
    unknown = [k for k in d if k not in fields]
    if unknown:
        raise TopologyError(
            f"the topology description has unknown field {unknown[0]!r}; its fields are {list(fields)} "
            f"(with 'hosts': {list(HOSTS_FIELDS)})"
        )
    links = d.get("links")
    if links is not None and not isinstance(links, Mapping):
        raise TopologyError(f"links is {links!r:.60}; give {{level: {{bandwidth_GBps: .., latency_us: ..}}}}")
    if "hosts" not in d:
        if "nodes" not in d:
            raise TopologyError("the topology description lacks 'nodes' (or 'hosts'); e.g. nodes: 1250")
        return regular(cls, *(d.get(f, 8 if f == "gpus_per_node" else None) for f in REGULAR_FIELDS))
    hosts = d["hosts"]
    if not isinstance(hosts, Sequence) or isinstance(hosts, str) or not hosts:
        raise TopologyError(f"hosts is {hosts!r:.60}; give a list of {{name, gpus, rack, pod}}")
    names, racks, pods = [], {}, {}
    for i, host in enumerate(hosts):
        if not isinstance(host, Mapping):
            raise TopologyError(f"hosts[{i}] is {host!r:.60}; give {{name: .., gpus: 8, rack: ..}}")
        bad = [k for k in host if k not in HOST_FIELDS]
        if bad:
            raise TopologyError(f"hosts[{i}] has unknown field {bad[0]!r}; a host has {list(HOST_FIELDS)}")
        if "name" not in host:
            raise TopologyError(f"hosts[{i}] lacks 'name'")
        gpus = _positive(host.get("gpus", 8), f"hosts[{i}].gpus")
        names += [str(host["name"])] * gpus
        for field, table in (("rack", racks), ("pod", pods)):
            if field in host:
                key = str(host["name"]) if field == "rack" else str(host.get("rack"))
                if key in table and table[key] != host[field]:  # as the constructor and Slurm paths refuse it
                    what = f"host {key!r}" if field == "rack" else f"rack {key!r}"
                    raise TopologyError(
                        f"hosts[{i}] puts {what} in {field} {host[field]!r}, but an earlier entry put it in "
                        f"{field} {table[key]!r}: a {'node' if field == 'rack' else 'rack'} lies in one {field}. "
                        f"Give each {what.split()[0]} one {field}"
                    )
                table[key] = host[field]
    if racks and len(racks) != len(set(names)):
        raise TopologyError("some hosts give a rack and others do not; give every host a rack (or none)")
    if pods and len(pods) != len(set(racks.values())):
        raise TopologyError("some racks have a pod and others not; give every host a pod (or none)")
    return from_hostnames(cls, names, racks or None, pods or None, links)


def load(cls, path, gpus_per_node):
    path = Path(path)
    if not path.is_file():
        raise TopologyError(f"topology file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ModuleNotFoundError as exc:
            raise TopologyError(f"{path} is YAML and PyYAML is not installed: pip install pyyaml, or use JSON") from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise TopologyError(f"{path} is not valid YAML: {exc}") from exc
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TopologyError(f"{path} is not valid JSON: {exc}") from exc
    else:
        hosts, racks, pods = slurm.parse(text, str(path))
        gpus = _positive(gpus_per_node if gpus_per_node is not None else 8, "gpus_per_node")
        return from_hostnames(cls, [h for h in hosts for _ in range(gpus)], racks, pods, None)
    try:
        return from_dict(cls, data)
    except TopologyError as exc:
        raise TopologyError(f"{path}: {exc}") from None
