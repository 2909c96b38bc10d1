"""Tiered checkpoints: every save committed into the nodes' local tiers (each item once per
node) and what only one node holds replicated to other nodes' over torch.distributed, every
`store_every`-th drained to a store in the background (each item once); a restart restores
each rank from the nearest copies that verify, on the same or another number of ranks.

    tiers = Tiers(local="/local_nvme/ckpt", store="s3://bucket/run", replicas=1,
                  store_every=5, keep_local=2, keep_store=3)
    async with Engine(tiers=tiers) as engine:
        result = await engine.restore(state)      # newest complete step, nearest tier
        await engine.save(state, step=100)        # the node's tier and its replicas

`_config` (the setting, the nodes), `_layout` (names on the tiers), `_placement` (who writes
which item, and which files go where), `_stream` (a shard's replicated files sent to another
rank's tier), `_manager` (saves, agreement, retention, drains), `_drain` (a step to the
store), `_catalog` (a step's shards on a node, as one checkpoint), `_fetch` (items sent from
another node's tier at restore), `_restore` (the restore's rounds).
"""

from asynctron.engine.tiers._config import Tiers
from asynctron.engine.tiers._layout import parse_shard
from asynctron.engine.tiers._restore import RestoreResult

__all__ = ["RestoreResult", "Tiers", "parse_shard"]
