"""``python -m fsg.topology plan``: the communication plan of a GPT-class model on a described cluster.

python -m fsg.topology plan --topology cluster.yaml --model gpt-175b
python -m fsg.topology plan --nodes 1250 --nodes-per-rack 32 --model gpt-70b --mesh dp=50,fsdp=25,tp=8
"""

from __future__ import annotations

import argparse
import sys

from fsg._src.errors import FsgError
from fsg._src.topology.cost import CostModel
from fsg._src.topology.description import Topology
from fsg._src.topology.plan import plan
from fsg._src.topology.workload import PRESETS, preset


def _mesh(text: str) -> dict:
    try:
        return {k: int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: write dp=50,fsdp=25,tp=8") from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fsg.topology", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="rank meshes for a model on a cluster (model predictions)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--topology", help="a .yaml/.json description or a Slurm topology.conf")
    where.add_argument("--nodes", type=int, help="a regular cluster of this many nodes")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes-per-rack", type=int)
    p.add_argument("--racks-per-pod", type=int)
    p.add_argument("--model", default="gpt-175b", help=f"one of {sorted(PRESETS)}")
    p.add_argument("--layers", type=int)
    p.add_argument("--d-model", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch", type=int, help="global batch in sequences")
    p.add_argument("--mesh", type=_mesh, action="append", help="a candidate, e.g. dp=50,fsdp=25,tp=8 (repeatable)")
    p.add_argument("--calibration", help="JSON written by benchmarks/collectives.py")
    p.add_argument("--top", type=int, default=8)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.topology:
            topo = Topology.load(args.topology, gpus_per_node=args.gpus_per_node)
        else:
            topo = Topology.regular(
                nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                nodes_per_rack=args.nodes_per_rack, racks_per_pod=args.racks_per_pod,
            )  # fmt: skip
        cfg = preset(args.model)
        changes = {"layers": args.layers, "d_model": args.d_model, "heads": args.heads,
                   "seq_len": args.seq_len, "global_batch": args.batch}  # fmt: skip
        cfg = cfg._replace(**{k: v for k, v in changes.items() if v is not None})
        model = CostModel.load(args.calibration) if args.calibration else CostModel()
        result = plan(cfg, args.mesh, topo, model=model)
    except FsgError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"model: {cfg.name}: {cfg.num_params / 1e9:.1f}B params, {cfg.layers} layers x {cfg.d_model}, "
          f"batch {cfg.global_batch} x {cfg.seq_len} tokens")  # fmt: skip
    print(result.as_text(args.top))
    return 0
