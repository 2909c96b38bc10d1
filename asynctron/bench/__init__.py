"""The benchmarks a user runs on their own machine: `asynctron bench SCENARIO [ARGS]`.

Each scenario is a module with `main(argv) -> int`; it runs asynctron and its peers in the same
process run, prints ratios (asynctron / peer, asynctron / physical baseline) and writes JSON
(`--out`, by default under ./asynctron-bench/). Peers are imported when a scenario needs them:
a missing one is named with the extra that installs it (`pip install asynctron[bench]`).
"""

from typing import NamedTuple


class Scenario(NamedTuple):
    """One `asynctron bench` scenario."""

    module: str
    """Its module under `asynctron.bench` (with `main(argv) -> int`)."""
    summary: str
    """What it measures, in one line (`asynctron bench --help` lists it)."""


#: `asynctron bench` scenario -> its module and what it measures
SCENARIOS = {
    "save": Scenario("save_throughput",
                     "save and load throughput against the peers and the disk's speed"),
    "cuda": Scenario("cuda_staging", "GPU staging and loads against a raw pinned copy (needs a "
                                     "GPU)"),
    "gpu": Scenario("gpu_check", "every CUDA test and CUDA benchmark, then one report"),
    "write": Scenario("write_sweep", "how fast asynctron saves to your storage, with which "
                                     "settings"),
    "comm": Scenario("allreduce_overlap", "all-reduce overlap: BucketManager against PyTorch "
                                          "DDP, on 2 ranks"),
    "data": Scenario("data_throughput", "dataset index builds and reads against megatron-core's"),
    "train": Scenario("train", "checkpoints inside a busy trainer against DCP and Megatron"),
    "many": Scenario("save_many", "100k small tensors saved by asynctron and its peers"),
    "train_data": Scenario("train_data", "data inside a busy trainer: AsyncLoader against "
                                         "DataLoader"),
    "hostile": Scenario("hostile_metadata", "the cost of reading crafted checkpoint metadata"),
    "dcp": Scenario("dcp_plugin", "stock DCP through its own writer and through asynctron's "
                                  "plugins"),
    "s3": Scenario("s3", "checkpoints on a local S3 server: raw aiobotocore, the S3 peers"),
    "s3_kills": Scenario("s3_kills", "savers killed at random on S3: what is left in the bucket"),
    "s3_down": Scenario("store_down", "a store that stops answering: how soon each operation "
                                      "fails"),
    "azure": Scenario("azure", "checkpoints on a local Azure Blob server: raw SDK, DCP over "
                               "adlfs"),
    "gcs": Scenario("gcs", "checkpoints on a local GCS server: raw aiohttp, DCP over gcsfs"),
    "tiers": Scenario("tiers", "tiered checkpoints against a plain save and stock DCP"),
    "all": Scenario("all", "every scenario in one command, each in its own process"),
}


__all__ = ["SCENARIOS", "Scenario"]
