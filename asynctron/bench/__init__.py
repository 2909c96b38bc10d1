"""The benchmarks a user runs on their own machine: `asynctron bench SCENARIO [ARGS]`.

Each scenario is a module with `main(argv) -> int`; it runs asynctron and its peers in the same
process run, prints ratios (asynctron / peer, asynctron / physical baseline) and writes JSON
(`--out`, by default under ./asynctron-bench/). Peers are imported when a scenario needs them:
a missing one is named with the extra that installs it (`pip install asynctron[bench]`).
"""

#: `asynctron bench` scenario -> its module under `asynctron.bench`
SCENARIOS = {
    "save": "save_throughput",
    "cuda": "cuda_staging",
    "gpu": "gpu_check",
    "write": "write_sweep",
    "comm": "allreduce_overlap",
    "data": "data_throughput",
    "train": "train",
    "many": "save_many",
    "train_data": "train_data",
    "hostile": "hostile_metadata",
    "dcp": "dcp_plugin",
    "s3": "s3",
    "s3_kills": "s3_kills",
    "s3_down": "store_down",
    "azure": "azure",
    "gcs": "gcs",
    "tiers": "tiers",
    "all": "all",
}

__all__ = ["SCENARIOS"]
