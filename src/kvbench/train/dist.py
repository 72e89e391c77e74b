"""Data parallelism for codec training: one process per GPU of a node, started by ``torchrun``.

The codec is tiny next to the frozen backbone and is applied inside forward hooks, not called as a module,
so instead of wrapping it in ``DistributedDataParallel`` the gradients are summed across processes with one
``all_reduce`` per parameter after the local backward passes. With the loss of each sequence scaled by
1 / global batch in every process, the summed gradient is the gradient of the global batch's mean loss, as
one process accumulating the same sequences computes it (for two processes the two sums are the same IEEE
additions, so the weights are bit-identical; ``tests/test_rkv_train_dist.py`` checks this with gloo).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class World:
    """This process's place among the training processes.

    Parameters
    ----------
    rank : int, 0 — this process (0 writes every file).
    size : int, 1 — processes; 1 = no ``torch.distributed`` calls at all.
    """

    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        """Whether this process writes the state and the outputs."""
        return self.rank == 0

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        """In place: every tensor becomes its sum over the processes (no-op for one process)."""
        if self.size > 1:
            for t in tensors:
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true in any process (every process gets the same answer)."""
        if self.size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64)
        if torch.distributed.get_backend() == "nccl":
            t = t.cuda()
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        """Wait for every process (no-op for one process)."""
        if self.size > 1:
            torch.distributed.barrier()


def init_world(device: str) -> World:
    """The :class:`World` of this process: from ``torchrun``'s ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
    (initialising the default process group: NCCL on CUDA, gloo on the CPU), else a single process.

    Returns:
        the world; on CUDA with several processes, ``torch.cuda.set_device(LOCAL_RANK)`` has been called.

    Raises:
        ValueError: ``WORLD_SIZE`` > 1 on CUDA with fewer visible GPUs than ``LOCAL_RANK`` + 1.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device.startswith("cuda")
    if cuda:
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} GPUs are visible")
        torch.cuda.set_device(local)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    return World(rank=rank, size=size)
