"""Point-to-point messages between pipeline ranks: activations forward, gradients backward.

Sends are ``dist.isend`` (waited at the end of the step), receives block where the action
needs them: a schedule the simulator found deadlock-free then cannot hang. Each tensor of a
message has its own tag, a function of (direction, receiving stage, microbatch, index), so
messages match by what they are, not by arrival order. A message between two stages of one
rank (interleaved on ``pp=1``) stays in a local mailbox.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


class Exchange:
    """One step's messages for the rank at pipeline index ``me``; ``ranks[i]`` is the global
    rank at pipeline index ``i``."""

    def __init__(self, me: int, ranks: Sequence[int], num_stages: int, num_microbatches: int, width: int):
        self._me, self._ranks = me, list(ranks)
        self._shape = (num_stages, num_microbatches, width)
        self._mailbox: dict[tuple, list[torch.Tensor]] = {}
        self._sent: list = []

    def _tag(self, kind: str, stage: int, microbatch: int, i: int) -> int:
        stages, micro, width = self._shape
        return (((kind == "B") * stages + stage) * micro + microbatch) * width + i

    def send(self, dst: int, key: tuple[str, int, int], tensors: Sequence[torch.Tensor]) -> None:
        """Sends ``tensors`` to pipeline index ``dst`` for ``key = (kind, stage, microbatch)``
        (``"F"``: activations into that stage; ``"B"``: gradients of that stage's outputs)."""
        if dst == self._me:
            self._mailbox[key] = list(tensors)
            return
        for i, t in enumerate(tensors):
            t = t.contiguous()
            self._sent.append((dist.isend(t, dst=self._ranks[dst], tag=self._tag(*key, i)), t))

    def receive(self, src: int, key: tuple[str, int, int], like: Sequence[torch.Tensor], device) -> list[torch.Tensor]:
        """The tensors pipeline index ``src`` sent for ``key``, shaped as ``like``."""
        if src == self._me:
            return self._mailbox.pop(key)
        out = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in like]
        works = [dist.irecv(t, src=self._ranks[src], tag=self._tag(*key, i)) for i, t in enumerate(out)]
        for w in works:
            w.wait()
        return out

    def finish(self) -> None:
        """Waits for every send of the step."""
        for work, _ in self._sent:
            work.wait()
        self._sent.clear()
