"""Tiered checkpoints: every save committed into the node's local tier and replicated to other
nodes' local tiers over torch.distributed, every `store_every`-th drained to a store in the
background; a restart restores each rank from the nearest tier that verifies.

    tiers = Tiers(local="/local_nvme/ckpt", store="s3://bucket/run", replicas=1,
                  store_every=5, keep_local=2, keep_store=3)
    async with Engine(tiers=tiers) as engine:
        result = await engine.restore(state)      # newest complete step, nearest tier
        await engine.save(state, step=100)        # the node's tier and its replicas

`_config` (the setting, the nodes), `_layout` (names on the tiers), `_stream` (a shard sent
to another rank's tier), `_manager` (saves, agreement, retention, drains), `_drain` (a step
to the store), `_restore` (the restore's rounds).
"""

from asynctron.engine.tiers._config import Tiers
from asynctron.engine.tiers._restore import RestoreResult

__all__ = ["RestoreResult", "Tiers"]

# The engine's own seam (not promised to users).
from asynctron.engine.tiers._config import job_nodes as job_nodes
from asynctron.engine.tiers._manager import TierManager as TierManager
