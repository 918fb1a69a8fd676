"""Rank functions for tests/dist/test_shifts.py (spawn-importable)."""

import torch

import fsg
import fsg.testing


def check_shifts(axes: dict, op: str) -> None:
    """Token ids shifted (``>>`` / ``<<``) pick embedding rows: sharded == unsharded."""
    torch.manual_seed(0)
    table = torch.nn.Embedding(64, 8)
    head = torch.nn.Linear(8, 1)

    def loss_fn(params, batch):
        ids = batch["ids"] >> 1 if op == ">>" else (batch["ids"] << 1) % 64
        emb = torch.nn.functional.embedding(ids, params["table"])
        return ((emb @ params["w"].T + params["b"]).squeeze(-1) - batch["y"]).pow(2).mean()

    params = {"table": table.weight.detach(), "w": head.weight.detach(), "b": head.bias.detach()}
    g = torch.Generator().manual_seed(1)
    batches = [{"ids": torch.randint(0, 64, (8, 4), generator=g), "y": torch.randn(8, 4, generator=g)} for _ in range(2)]
    fsg.testing.assert_sharded_matches_unsharded(
        loss_fn, params, batches, fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.1), batch_sharding=fsg.P("dp")
    )
