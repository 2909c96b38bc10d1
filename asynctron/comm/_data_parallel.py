"""`AsyncDataParallel`: the trainer face of the bucket manager, a module wrapper in a few lines
(named apart from `torch.nn.DataParallel` and DDP, which it does not replace in `import`s).

    model = AsyncDataParallel(net, bucket_size_bytes=25 * 2**20)
    await model.broadcast_parameters()          # every rank starts from rank 0's weights
    for batch in batches:
        loss_fn(model(batch)).backward()        # all-reduces launch during backward
        await model.step(optimizer)             # synchronize, optimizer.step(), zero_grad()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Unpack

import torch
import torch.distributed as dist

from asynctron._concurrency import RunBlocking
from asynctron.comm._bridge import peer_error, wait_work
from asynctron.comm._manager import BucketConfig, BucketManager, BucketOptions, StepTimings


class AsyncDataParallel(torch.nn.Module):
    """Wraps `module` for data-parallel training with a `BucketManager`.

    `forward` is the module's; `no_sync()`, `synchronize()` and `zero_grad()` are the
    manager's; `step(optimizer)` does the three calls that end a step. Configured as the
    manager: a `BucketConfig`, or its fields as keywords (`bucket_size_bytes`,
    `find_unused_parameters`, `grad_dtype`, ...), not both.

    Unlike DDP, construction does not communicate: `await broadcast_parameters()` makes every
    rank start from the same weights, and buffers (e.g. BatchNorm statistics) are not
    broadcast at each forward.
    """

    def __init__(self, module: torch.nn.Module, config: BucketConfig | None = None, *,
                 process_group: dist.ProcessGroup | None = None,
                 run_blocking: RunBlocking | None = None,
                 **options: Unpack[BucketOptions]) -> None:
        super().__init__()
        self.module = module
        self._run_blocking = run_blocking
        self.manager = BucketManager(module, config, process_group=process_group,
                                     run_blocking=run_blocking, **options)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    async def broadcast_parameters(self, src: int = 0) -> None:
        """Copy rank `src`'s parameters and buffers to every rank (all ranks call it).

        Raises:
            PeerError: a broadcast failed.

        Cancellation: the broadcasts cannot be un-launched; the tensors may be partly
        overwritten until they finish.
        """
        group = self.manager.process_group
        src_global = dist.get_global_rank(group if group is not None else dist.group.WORLD, src)
        tensors = [*self.module.parameters(), *self.module.buffers()]
        with torch.no_grad():
            works = [dist.broadcast(tensor.data, src=src_global, group=group, async_op=True)
                     for tensor in tensors]
        try:
            for work in works:
                assert work is not None
                await wait_work(work, run_blocking=self._run_blocking)
        except (RuntimeError, dist.DistError) as exc:
            raise peer_error(f"broadcast of parameters from rank {src_global}", group,
                             exc) from exc

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside only accumulates; see `BucketManager.no_sync`."""
        with self.manager.no_sync():
            yield

    async def synchronize(self) -> None:
        """Wait for the step's all-reduces; see `BucketManager.synchronize`."""
        await self.manager.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the step and the gradients; see `BucketManager.zero_grad`."""
        self.manager.zero_grad(set_to_none)

    async def step(self, optimizer: torch.optim.Optimizer) -> None:
        """End a step: `await synchronize()`, `optimizer.step()`, `zero_grad()`.

        Raises and Cancellation: as `BucketManager.synchronize` (a cancelled step has not
        touched the weights).
        """
        await self.manager.synchronize()
        optimizer.step()
        self.manager.zero_grad()

    @property
    def last_step(self) -> StepTimings | None:
        """Timings of the last synchronized step; see `BucketManager.last_step`."""
        return self.manager.last_step
