"""NVIDIA's resiliency extension's local checkpointing, run on the CPU as a peer of the tiers:
its `LocalCheckpointManager` with a clique replication strategy (each rank's shard also kept
by the same local rank of the next node), fed by a CPU `TensorAwareStateDict`.

The extension's own state dict (`BasicTensorAwareStateDict`) asserts every tensor is on CUDA,
and its asynchronous save waits with `torch.cuda.synchronize()`; on a CPU machine only its
synchronous save runs, through this adapter (its tensors are already on the host, so the D2H
copy it skips is nothing). Imported only when the extension is installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
    LocalCheckpointManager,
)
from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
    CliqueReplicationStrategy,
)


class CpuStateDict(TensorAwareStateDict):
    """A flat dict of CPU tensors as the extension's managers take one (module-level: the
    replication pickles its hollow form)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self._state: dict[str, torch.Tensor | None] = dict(state)
        self._hollow: list[tuple[torch.Size, torch.dtype]] | None = None

    def pop_tensors(self) -> Sequence[torch.Tensor]:
        tensors = [tensor for tensor in self._state.values() if tensor is not None]
        self._hollow = [(tensor.shape, tensor.dtype) for tensor in tensors]
        self._state = dict.fromkeys(self._state)
        return tensors

    def tensors(self) -> Iterable[torch.Tensor]:
        return [tensor for tensor in self._state.values() if tensor is not None]

    @property
    def is_hollow(self) -> bool:
        return self._hollow is not None

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        self._state = dict(zip(self._state, tensor_data, strict=True))
        self._hollow = None

    def init_tensors(self) -> None:
        assert self._hollow is not None
        self._state = {key: torch.empty(shape, dtype=dtype)
                       for key, (shape, dtype) in zip(self._state, self._hollow, strict=True)}
        self._hollow = None

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Nothing to copy: the tensors are on the host."""

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Nothing to move: they were on the host."""

    def state(self) -> dict[str, torch.Tensor | None]:
        return self._state


def manager(root: str, ranks_per_node: int) -> LocalCheckpointManager:
    """A manager keeping this rank's checkpoints under `root` (its node's local directory),
    each also by the same local rank of the next node."""
    strategy = CliqueReplicationStrategy.from_replication_params(
        replication_jump=ranks_per_node, replication_factor=2)
    return LocalCheckpointManager(root, repl_strategy=strategy)
