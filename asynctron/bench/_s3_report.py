"""The summary and the printed report of `asynctron bench s3`: per method, the medians over
rounds of each round's slowest rank, asynctron's ratios over the raw baseline and the peers,
and the table. The Azure and GCS benches summarize and print their rounds with these."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from asynctron.bench._s3_methods import (
    BUDGET_4,
    OURS,
    PEERS,
    PROXY_BUDGET_4,
    PROXY_THROTTLED,
    RAW,
    RAW_ONE,
    RAW_SIGNED,
    THROTTLE_LIMIT,
    THROTTLE_METHODS,
    THROTTLED,
    GiB,
    MiB,
)

TABLE_LEGEND = ("blocks: until the caller may go on (asynctron: `await task.staged`); CPU: client "
                "process time (every thread) per GB moved; loop: worst heartbeat delay during the "
                "save / the load; RSS+: peak growth (asynctron's save includes its staging "
                "slabs); in flight: most requests at once")
"""What `table`'s columns mean, printed under it."""


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(rounds: dict[str, list[dict[str, Any]]], *, raw: str = RAW,
              peers: Sequence[str] = PEERS) -> dict[str, Any]:
    """Per method: medians over rounds of each round's slowest rank (worst rank for delays,
    memory and requests; all ranks' CPU over all their bytes); the ratios of `OURS` over `raw`
    (the physical baseline) and over the fastest of `peers` (other stores' benchmarks pass
    their own)."""
    summary: dict[str, Any] = {}
    for name, runs in rounds.items():
        nbytes = sum(rank["nbytes"] for rank in runs[0]["ranks"])
        def worst(field: str, runs: list[dict[str, Any]] = runs) -> list[float]:
            values = [[r[field] for r in run["ranks"] if r.get(field) is not None]
                      for run in runs]
            return [max(v) for v in values if v]

        def total(field: str, runs: list[dict[str, Any]] = runs) -> list[float]:
            return [sum(r[field] for r in run["ranks"]) for run in runs
                    if all(field in r for r in run["ranks"])]

        save_s, load_s = median(worst("save_s")), median(worst("load_s"))
        summary[name] = {
            "save_median_s": save_s, "load_median_s": load_s,
            "nbytes": nbytes,
            "save_gb_per_s": nbytes / save_s / 1e9, "load_gb_per_s": nbytes / load_s / 1e9,
            "save_cpu_s_per_gb": median(total("save_cpu_s")) / (nbytes / 1e9),
            "load_cpu_s_per_gb": median(total("load_cpu_s")) / (nbytes / 1e9),
            "blocking_median_s": median(worst("blocking_s")),
            "loop_worst_delay_median_s": median(worst("loop_worst_delay_s")),
            "load_loop_worst_delay_median_s": median(worst("load_loop_worst_delay_s")),
            "save_peak_rss_growth_median_bytes": median(worst("save_peak_rss_growth_bytes")),
            "load_peak_rss_growth_median_bytes": median(worst("load_peak_rss_growth_bytes")),
            "most_in_flight": max(worst("most_in_flight"), default=None),
            **{f"{field}_median_s": median(worst(field)) for field in ("call_s", "prefault_s")
               if worst(field)},
            **{f"{field}_per_round": total(field) for field in (
                "save_requests", "save_throttled", "load_requests", "load_throttled",
                "load_lists") if total(field)},
            "rounds": runs}
    ratios: dict[str, Any] = {}
    peers = [name for name in peers if name in summary]

    def over(mine: str, theirs: str) -> dict[str, float]:
        return {what: summary[mine][f"{what}_gb_per_s"] / summary[theirs][f"{what}_gb_per_s"]
                for what in ("save", "load")}

    if RAW in summary and RAW_SIGNED in summary:
        ratios["signed_over_unsigned"] = over(RAW_SIGNED, RAW)
    if THROTTLED in summary and BUDGET_4 in summary:
        ratios["throttled_over_budget_4"] = over(THROTTLED, BUDGET_4)
    if PROXY_THROTTLED in summary and PROXY_BUDGET_4 in summary:
        ratios["proxy_throttled_over_budget_4"] = over(PROXY_THROTTLED, PROXY_BUDGET_4)
    if OURS in summary:
        ours = summary[OURS]
        if raw in summary:
            ratios["asynctron_over_raw"] = over(OURS, raw)
        if RAW_ONE in summary:
            ratios["asynctron_over_raw_one_process"] = over(OURS, RAW_ONE)
        for what in ("save", "load") if peers else ():
            best = max(peers, key=lambda name: summary[name][f"{what}_gb_per_s"])
            ratios.setdefault("asynctron_over_fastest_peer", {})[what] = {
                "peer": best, "ratio": ours[f"{what}_gb_per_s"] / summary[best][
                    f"{what}_gb_per_s"]}
        if peers:
            least = min(peers, key=lambda name: summary[name]["blocking_median_s"])
            ratios["asynctron_blocking_over_least_peer"] = {
                "peer": least, "ratio": ours["blocking_median_s"]
                / summary[least]["blocking_median_s"]}
    return {"methods": summary, "ratios": ratios}


def report(result: dict[str, Any]) -> None:
    table(result["methods"], f"S3 checkpoints: {result['nbytes'] / GiB:.2f} GiB state "
           f"({result['num_tensors']} tensors per rank), {result['world_size']} rank(s), one "
           "local SeaweedFS")
    print(TABLE_LEGEND)
    ratios = result["ratios"]
    if "signed_over_unsigned" in ratios:
        cost = ratios["signed_over_unsigned"]
        print(f"raw signed + checksums / raw unsigned: save {cost['save']:.2f}x, "
              f"load {cost['load']:.2f}x")
    for key, what in (("asynctron_over_raw", "raw (unsigned)"),
                      ("asynctron_over_raw_one_process", RAW_ONE)):
        if key in ratios:
            print(f"asynctron / {what}: save {ratios[key]['save']:.2f}x, "
                  f"load {ratios[key]['load']:.2f}x")
    for what, best in ratios.get("asynctron_over_fastest_peer", {}).items():
        print(f"asynctron / fastest peer, {what}: {best['ratio']:.2f}x ({best['peer']})")
    if "asynctron_blocking_over_least_peer" in ratios:
        least = ratios["asynctron_blocking_over_least_peer"]
        methods = result["methods"]
        print(f"asynctron blocking / shortest peer's: {least['ratio']:.3f}x ({least['peer']}); "
              f"engine.save returned in {methods[OURS].get('call_s_median_s', 0) * 1e3:.1f} ms")
    if OURS in result["methods"] and "load_lists_per_round" in result["methods"][OURS]:
        print(f"asynctron: LIST requests per load, all ranks: "
              f"{max(result['methods'][OURS]['load_lists_per_round'])}")
    if "throttle" in result:
        throttle = result["throttle"]
        table(throttle["methods"], f"throttled store: {throttle['nbytes'] / GiB:.2f} GiB, the "
               f"server's circuit breaker answering 503 beyond {THROTTLE_LIMIT} reads or writes "
               f"in flight, or a proxy beyond {THROTTLE_LIMIT} requests")
        for name in THROTTLE_METHODS:
            m = throttle["methods"].get(name, {})
            if "save_throttled_per_round" in m:
                print(f"{name}: answered 503 per save {m['save_throttled_per_round']} of "
                      f"{m['save_requests_per_round']} requests, per load "
                      f"{m['load_throttled_per_round']} of {m['load_requests_per_round']}")
        for key, what in (("throttled_over_budget_4", "throttled / budget 4, no throttle"),
                          ("proxy_throttled_over_budget_4",
                           "proxy throttled / budget 4 via the proxy")):
            if key in throttle["ratios"]:
                cost = throttle["ratios"][key]
                print(f"{what}: save {cost['save']:.2f}x, load {cost['load']:.2f}x")
    if "store_profile" in result:
        shaped = result["store_profile"]
        print(f"store profile {shaped['profile']}: {shaped['num_requests']} requests "
              f"({shaped['num_slowdowns']} answered 503 by the proxy), "
              f"{shaped['up_bytes'] / 1e9:.2f} GB up, {shaped['down_bytes'] / 1e9:.2f} GB down")
    for name, reason in result["skipped"].items():
        print(f"not run: {name}: {reason}")


def table(methods: dict[str, Any], title: str) -> None:
    first = next(iter(methods.values()))
    print(f"\n== {title}; medians of {len(first['rounds'])} rounds ==")
    print(f"{'method':<36}{'save GB/s':>10}{'load GB/s':>10}{'save CPU':>9}{'load CPU':>9}"
          f"{'blocks s':>9}{'loop ms':>14}{'save RSS+':>11}{'load RSS+':>11}{'in flight':>10}")
    for name, m in methods.items():
        in_flight = "-" if m["most_in_flight"] is None else f"{m['most_in_flight']:.0f}"
        loops = (f"{m['loop_worst_delay_median_s'] * 1e3:.1f}/"
                 f"{m['load_loop_worst_delay_median_s'] * 1e3:.1f}")
        print(f"{name:<36}{m['save_gb_per_s']:>10.3f}{m['load_gb_per_s']:>10.3f}"
              f"{m['save_cpu_s_per_gb']:>9.2f}{m['load_cpu_s_per_gb']:>9.2f}"
              f"{m['blocking_median_s']:>9.3f}{loops:>14}"
              f"{m['save_peak_rss_growth_median_bytes'] / MiB:>7.0f} MiB"
              f"{m['load_peak_rss_growth_median_bytes'] / MiB:>7.0f} MiB{in_flight:>10}")
