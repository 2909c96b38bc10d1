"""The summary and the printed report of `asynctron bench data --source s3`: medians per
method, the targets, whether every method's first samples are the same, and the object cache's
size during the cold epoch (a table, and a plot where matplotlib imports)."""

from __future__ import annotations

import statistics
from typing import Any

from asynctron.bench._data_s3_methods import (
    COLD,
    DATALOADER,
    DATALOADER_WORKERS,
    EPOCH,
    LOCAL,
    MEGATRON,
    SUBSET,
    TRAINERS,
    WARM,
    GiB,
    MiB,
)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(runs: dict[str, list[dict[str, Any]]], num_verify: int) -> dict[str, Any]:
    """Medians per method, the targets, and whether the first samples are the same."""
    medians: dict[str, dict[str, float]] = {}
    for label, results in runs.items():
        keys = [k for k, v in results[0].items() if isinstance(v, int | float)]
        medians[label] = {k: _median([r[k] for r in results]) for k in keys}
        if "bytes_fetched" in medians[label]:
            medians[label]["fetched_per_used"] = _median(
                [r["bytes_fetched"] / r["bytes_used"] for r in results])
    targets = []

    def target(what: str, value: float, goal: str, met: bool | None) -> None:
        targets.append({"what": what, "value": value, "target": goal, "met": met})

    cold = medians.get(f"{COLD}, idle")
    if cold is not None:
        peers = [f"{MEGATRON}, idle"] + [f"{DATALOADER.format(n)}, idle"
                                         for n in DATALOADER_WORKERS]
        peers = [peer for peer in peers if peer in medians]
        if len(peers) > 1 and peers[0] == f"{MEGATRON}, idle":
            best = max(peers[1:], key=lambda p: medians[p]["samples_per_s"])
            for peer in (peers[0], best):
                ratio = cold["samples_per_s"] / medians[peer]["samples_per_s"]
                target(f"asynctron S3 cold / {peer.removesuffix(', idle')} (samples/s)",
                       ratio, ">= 3x", ratio >= 3)
        for trainer in TRAINERS:
            if (warm := medians.get(f"{WARM}, {trainer}")) and (
                    local := medians.get(f"{LOCAL}, {trainer}")):
                ratio = warm["samples_per_s"] / local["samples_per_s"]
                target(f"asynctron S3 warm / asynctron local, {trainer} (samples/s)", ratio,
                       ">= 0.9x", ratio >= 0.9)
        for trainer in TRAINERS:
            if row := medians.get(f"{COLD}, {trainer}"):
                target(f"p95 batch wait, asynctron S3 cold, {trainer} (ms)",
                       row["wait_p95_s"] * 1e3, "<= 50 ms", row["wait_p95_s"] <= 0.05)
        epoch = medians.get(f"{EPOCH}, idle", cold)
        whole = epoch["num_samples"] > epoch["epoch_samples"] - 2 * epoch["micro_batch_size"]
        target("bytes fetched / bytes used, " + ("an epoch" if whole else
               f"{epoch['num_samples']:,.0f} samples") + " (cold)", epoch["fetched_per_used"],
               "<= 1.2", epoch["fetched_per_used"] <= 1.2)
        if subset := medians.get(f"{SUBSET}, idle"):
            target("bytes fetched / bytes used, 1% of the samples (cold)",
                   subset["fetched_per_used"], "a small multiple", None)
    firsts = {label: results[0]["digests"] for label, results in runs.items()}
    reference = firsts.get(f"{LOCAL}, idle", [])[:num_verify]
    differ = sorted(label for label, digests in firsts.items()
                    if digests != reference[:len(digests)])
    return {"medians": medians, "targets": targets, "samples_match": not differ,
            "samples_differ": differ, "num_verified": len(reference)}


def _table(series: list[list[float]], rows: int = 12) -> list[str]:
    step = max(1, len(series) // rows)
    picked = series[::step] + ([series[-1]] if (len(series) - 1) % step else [])
    return [f"  {t:8.2f} s {cached / MiB:>10,.0f} MiB cached {fetched / MiB:>10,.0f} MiB fetched"
            for t, cached, fetched in picked]


def report(result: dict[str, Any]) -> None:
    s = result["summary"]
    print(f"\n== datasets on S3: {result['corpus_bytes'] / GiB:.2f} GiB corpus, "
          f"{result['epoch_samples']:,} samples of {result['sequence_length']}, micro batch "
          f"{result['micro_batch_size']}; {result['server']}; medians of "
          f"{result['repeats']} runs ==")
    print(f"  {'method':<42}{'samples/s':>12}{'first s':>9}{'wait p50/p95/max ms':>26}"
          f"{'fetched/used':>14}")
    for label, row in s["medians"].items():
        fetched = f"{row['fetched_per_used']:.3f}" if "fetched_per_used" in row else "-"
        print(f"  {label:<42}{row['samples_per_s']:>12,.1f}{row['first_batch_s']:>9.2f}"
              f"{row['wait_p50_s'] * 1e3:>10.2f} /{row['wait_p95_s'] * 1e3:>7.1f} /"
              f"{row['wait_max_s'] * 1e3:>7.0f}{fetched:>14}")
    print("  waits: the consumer's, after the first batch (its wait is 'first'); fetched/used: "
          "bytes GET from the store while reading / bytes of the samples' tokens")
    for t in s["targets"]:
        verdict = {True: "met", False: "NOT MET", None: "see the value"}[t["met"]]
        print(f"  {t['what']}: {t['value']:.2f} (target {t['target']}) {verdict}")
    for label, reason in result["not_run"].items():
        print(f"  not run: {label}: {reason}")
    if s["samples_match"]:
        print(f"  samples: the first {s['num_verified']} of every method are identical "
              "(tokens and labels)")
    else:
        print(f"  samples DIFFER from asynctron local's: {s['samples_differ']}")
    if series := result.get("cache_series"):
        print(f"  object cache during the first cold epoch ({len(series)} samples):")
        print("\n".join(_table(series)))


def plot(series: list[list[float]], path: str) -> str | None:
    """The cache's size and the bytes fetched over the cold run, as a PNG at `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(figsize=(7, 4))
    t = [row[0] for row in series]
    axes.plot(t, [row[1] / MiB for row in series], label="bytes cached")
    axes.plot(t, [row[2] / MiB for row in series], label="bytes fetched", linestyle="--")
    axes.set_xlabel("seconds since the run's process started")
    axes.set_ylabel("MiB")
    axes.set_title("asynctron's object cache during a cold epoch")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
