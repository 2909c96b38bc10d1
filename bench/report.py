"""Render the benchmark report, `docs/benchmarks.md` and its plots, from the JSON results that
`asynctron bench all --results DIR` (or each scenario with `--out`) wrote: one section per
scenario, with the command, asynctron against each peer and the physical baselines as ratios,
and the machine.

Run: `python -m bench.report RESULTS_DIR [--docs docs]`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Callable
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless; must precede the pyplot import
import matplotlib.pyplot as plt

from asynctron.bench.all import RUNS
from asynctron.bench.write_sweep import Result, Setting, plot

GiB = 1 << 30
MiB = 1 << 20

#: scenario -> the command that measures it alone (its results file: `asynctron.bench.all.RUNS`)
COMMANDS = {
    "save": "asynctron bench save --targets /dev/shm,$PWD/.benchtmp",
    "save_ranks2": "asynctron bench save --nproc 2 --target $PWD/.benchtmp",
    "save_ranks4": "asynctron bench save --nproc 4 --target $PWD/.benchtmp",
    "data": "asynctron bench data",
    "comm": "asynctron bench comm",
    "comm_busy": "asynctron bench comm --trainer python --models 10M --bucket-mb 25",
    "comm_dispatch": "asynctron bench comm --trainer dispatch --models 10M --bucket-mb 25",
    "comm_torch": "asynctron bench comm --trainer torch --models 10M --bucket-mb 25",
    "write": "asynctron bench write --target $PWD/.benchtmp",
    "cuda": "asynctron bench cuda",
    "train": "asynctron bench train",
    "many": "asynctron bench many",
    "train_data": "asynctron bench train_data",
    "hostile": "asynctron bench hostile",
    "dcp": "asynctron bench dcp --target /dev/shm --target $PWD/.benchtmp",
    "s3": "asynctron bench s3 --size-gib 0.25 --repeats 2",
    "s3_restarts": "asynctron bench s3 --ranks 8 --size-gib 1 --repeats 3",
    "tiers": "asynctron bench tiers --target $PWD/.benchtmp",
    "tiers_shm": "asynctron bench tiers --target /dev/shm",
    "data_s3": "asynctron bench data --source s3 --corpus-mib 512 --megatron-limit-s 20 "
               "--repeats 2",
}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join("---:" if i else "---" for i in range(len(header))) + " |"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _ok(passed: bool) -> str:
    return "✓" if passed else "✗"


def machine(results: dict[str, Any]) -> list[str]:
    meta = next(r["meta"] for r in results.values() if "meta" in r)
    peers = results.get("save", {}).get("meta", {}).get("peers", {})
    versions = ", ".join(f"{k} {v}" for k, v in peers.items())
    return [f"Measured on {meta['date']} on `{meta['host']}`: {meta['cpu_count']} cores, "
            f"{meta.get('memory_bytes', 0) / GiB:.0f} GiB of memory, Linux "
            f"{meta.get('kernel', '?')}, Python {meta['python']}, asynctron "
            f"{meta['asynctron']}" + (f"; peers: {versions}" if versions else "") + ". "
            "The disk is the VM's virtio disk under the working directory (ext4); `/dev/shm` is "
            "tmpfs (RAM). Guest memory is touched once before timing (first touch of a guest "
            "page costs 20x a later one on this VM), and methods take turns within each round, "
            "so drift hits all alike. Medians of the rounds; ratios are measured in one run. "
            "The host is shared: between two runs on the same day a method's median moved by up "
            "to 1.5x (the disk above all, whose writeback the host caches), so compare within "
            "one table and read differences under ~10% as ties."]


def section_save(result: dict[str, Any], docs: str) -> list[str]:
    lines = ["Every method saves the same state dict to the same target; `asynctron x` is the "
             "method's time / asynctron's (above 1: asynctron is faster). `raw pwrite+fsync` is "
             "the issue's physical baseline (one thread, buffered); `raw O_DIRECT` is what the "
             "device takes from one aligned stream. `asynctron (in place)` is `snapshot=False` "
             "(the caller waits for the whole save, as with the synchronous peers); "
             "`asynctron (no checksum)` measures the checksum's cost.", ""]
    for s in result["scenarios"]:
        lines += [f"**{s['label']}** ({s['nbytes'] / GiB:.2f} GiB, {s['num_tensors']} tensors)",
                  ""]
        rows = [[name, f"{v['median_s']:.3f}", f"{v['gb_per_s']:.2f}",
                 f"{v['asynctron_speedup']:.2f}x"]
                for name, v in sorted(s["saves"].items(), key=lambda kv: kv[1]["median_s"])]
        lines += [*_table(["method", "median s", "GB/s", "asynctron x"], rows), ""]
        lines += [f"- {line}" for line in s["targets"]]
        loads = s["loads_s"]
        versus_raw = loads["load: raw read"] / loads["load: asynctron"]
        lines += [f"- load ({'cold, page cache evicted' if s.get('on_disk') else 'tmpfs'}): "
                  f"raw read {loads['load: raw read']:.3f} s, asynctron "
                  f"{loads['load: asynctron']:.3f} s = {versus_raw:.2f}x the raw read "
                  f"(target >= 0.9x {_ok(versus_raw >= 0.9)}); mmap load "
                  f"{loads['load: asynctron mmap'] * 1e3:.1f} ms", ""]
    budget = result["budget"]
    growth_mib = budget["rss_growth_bytes"] / MiB
    limit_mib = budget["budget_bytes"] / MiB + 256
    lines += [f"Memory: saving {budget['state_bytes'] / MiB:.0f} MiB with a "
              f"{budget['budget_bytes'] / MiB:.0f} MiB budget (4x smaller) grew the peak RSS by "
              f"{growth_mib:.0f} MiB (target <= budget + 256 MiB = {limit_mib:.0f} MiB "
              f"{_ok(growth_mib <= limit_mib)}); staging peaked at "
              f"{budget['peak_borrowed_bytes'] / MiB:.0f} MiB.", ""]
    lines += _first_saves(result.get("first_save"))
    _plot_save(result, os.path.join(docs, "benchmarks_save.png"))
    return [*lines, "![save throughput](benchmarks_save.png)"]


def _first_saves(first: dict[str, Any] | None) -> list[str]:
    """The first save in a fresh process, per target."""
    if first is None:
        return []
    lines = [f"**The first save in a fresh process** ({first['size_gib']:g} GiB mixed state; "
             "one process per save, so no staging memory is warm; medians). `asynctron "
             "prefaulted` called `engine.prefault_staging(state bytes)` first, as a trainer does "
             "at start-up; that call is the *prefault* column, outside the save.", ""]
    for kind, data in first["targets"].items():
        medians = data["medians"]
        rows = [[method, f"{m['blocking_s']:.3f}", f"{m['total_s']:.3f}",
                 f"{m['prefault_s']:.3f}" if "prefault_s" in m else "–"]
                for method, m in sorted(medians.items(), key=lambda kv: kv[1]["total_s"])]
        lines += [f"{kind}:", "", *_table(["method", "blocking s", "total s", "prefault s"],
                                          rows), ""]
    return lines


def _plot_save(result: dict[str, Any], path: str) -> None:
    scenarios = result["scenarios"]
    figure, axes = plt.subplots(1, len(scenarios), figsize=(4.4 * len(scenarios), 4.8))
    for axis, s in zip(axes if len(scenarios) > 1 else [axes], scenarios, strict=True):
        names = sorted(s["saves"], key=lambda n: s["saves"][n]["gb_per_s"])
        speeds = [s["saves"][n]["gb_per_s"] for n in names]
        colors = ["tab:orange" if n.startswith("asynctron") else
                  "tab:gray" if n.startswith("raw") else "tab:blue" for n in names]
        axis.barh(names, speeds, color=colors)
        axis.set_title(f"{s['label']} ({s['nbytes'] / GiB:.1f} GiB)", fontsize=10)
        axis.set_xlabel("GB/s (median)")
        axis.tick_params(axis="y", labelsize=7)
    figure.suptitle("checkpoint save throughput (orange: asynctron, gray: physical baselines)",
                    fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def section_save_ranks(result: dict[str, Any], docs: str) -> list[str]:
    world = result["world_size"]
    rows = [[name, f"{v['median_s']:.3f}", f"{v['gb_per_s']:.2f}",
             f"{v['asynctron_speedup']:.2f}x"]
            for name, v in sorted(result["saves"].items(), key=lambda kv: kv[1]["median_s"])]
    per_rank = result["per_rank"]
    saves = result["saves"]
    ours = saves["asynctron"]["median_s"]
    lines = [f"{world} spawned gloo ranks, each saving its own share (FSDP-like) of "
             f"{result['nbytes'] / GiB:.2f} GiB in all; a round lasts as long as its slowest "
             "rank.", ""]
    lines += [*_table(["method", "median s", "GB/s (aggregate)", "asynctron x"], rows), ""]
    for peer in ("dcp.save", "dcp.async_save"):
        ratio = saves[peer]["median_s"] / ours
        lines.append(f"- vs {peer}: {ratio:.2f}x (target: ahead {_ok(ratio > 1)})")
    lines += [
        "- blocking per rank: asynctron (`await task.staged`) "
        + ", ".join(f"{v:.3f}" for v in per_rank["staged_s"]) + " s; `dcp.async_save` "
        + ", ".join(f"{v:.3f}" for v in per_rank["dcp_async_blocking_s"]) + " s",
        "- planning per rank: uncached " + ", ".join(
            f"{v * 1e3:.1f}" for v in per_rank["plan_uncached_s"]) + " ms; cached (seed 002) "
        + ", ".join(f"{v * 1e3:.1f}" for v in per_rank["plan_s"]) + " ms",
        "- loop worst heartbeat delay per rank: "
        + ", ".join(f"{v * 1e3:.1f}" for v in result["loop_worst_delay_s"]) + " ms", ""]
    return lines


def section_data(result: dict[str, Any], docs: str) -> list[str]:
    if result.get("megatron"):
        return [f"megatron-core: {result['megatron']}"]
    index_result = result["index_build"]
    index = index_result["timings_s"]
    pairs = [("sample index, {:.1f} M samples (time)".format(
        result["index_build"]["sample_index_rows"] / 1e6),
        "asynctron sample index (numpy)", "megatron sample index (C++)", "<= 1.0x"),
        ("GPTDataset index build on a cache miss (time)", "asynctron GPTDataset build",
         "megatron GPTDataset build", "<= 1.0x"),
        ("blending index, {:.0f} M samples (time)".format(
            result["index_build"]["blend_samples"] / 1e6),
         "asynctron blending index (C)", "megatron blending index (C++)", "<= 1.0x")]
    rows = []
    for label, ours, theirs, target in pairs:
        a, b = _median(index[ours]), _median(index[theirs])
        rows.append([label, f"{a:.3f} s", f"{b:.3f} s", f"{a / b:.2f}x",
                     target if target == "-" else f"{target} {_ok(a / b <= 1.0)}"])
    peaks = index_result.get("blend_peak_rss_growth_bytes")
    if peaks:
        a, b = peaks["asynctron blending index (C)"], peaks["megatron blending index (C++)"]
        out = index_result["blend_output_bytes"]
        rows.append([f"blending index, peak memory growth (output {out / 1e6:.0f} MB)",
                     f"{a / 1e6:,.0f} MB", f"{b / 1e6:,.0f} MB", f"{a / b:.2f}x",
                     f"<= 3x output {_ok(a <= 3 * out)}"])
    scale = result.get("blend_scale")
    if scale and "megatron" in scale:
        ours_s, theirs_s = (_median(scale[k]["seconds"]) for k in ("asynctron", "megatron"))
        rows.append(["blending index, {:.0f} M samples of {} datasets (time{})".format(
            scale["samples"] / 1e6, len(scale["weights"]),
            ", arrays identical" if scale.get("identical") else ", ARRAYS DIFFER"),
            f"{ours_s:.1f} s", f"{theirs_s:.1f} s", f"{ours_s / theirs_s:.2f}x",
            "reported"])
        a, b = (scale[k]["peak_rss_growth_bytes"] for k in ("asynctron", "megatron"))
        rows.append(["same, peak memory growth (output {:.1f} GB)".format(
            scale["output_bytes"] / 1e9), f"{a / 1e9:.2f} GB", f"{b / 1e9:.2f} GB",
            f"{a / b:.2f}x", "reported"])
    for mask, warm in result["warm"].items():
        a, b = warm["samples_per_s"]["asynctron"], warm["samples_per_s"]["megatron"]
        rows.append([f"warm random `ds[i]`, {mask} (samples/s)", f"{a:,.0f}", f"{b:,.0f}",
                     f"{a / b:.2f}x", f">= 1.0x {_ok(a / b >= 1.0)}"])
    cold = result["cold"]["samples_per_s"]
    a, b = cold["asynctron AsyncLoader (prefetch)"], cold["megatron ds[i]"]
    rows.append(["cold epoch: AsyncLoader with prefetch vs megatron `ds[i]` (samples/s)",
                 f"{a:,.0f}", f"{b:,.0f}", f"{a / b:.2f}x", f">= 2x {_ok(a / b >= 2)}"])
    rows.append(["cold epoch: prefetch vs asynctron `ds[i]` without prefetch", f"{a:,.0f}",
                 f"{cold['asynctron ds[i] (no prefetch)']:,.0f}",
                 f"{a / cold['asynctron ds[i] (no prefetch)']:.2f}x", "-"])
    delay, idle = (result["cold"][k] * 1e3 for k in ("loop_worst_delay_s",
                                                     "idle_loop_worst_delay_s"))
    return [*_table(["measure", "asynctron", "megatron-core", "ratio", "target"], rows), "",
            f"- loop worst heartbeat delay while the loader ran: {delay:.1f} ms (an idle loop "
            f"over the same time: {idle:.1f} ms)",
            *([f"- {result['meta']['blend_runs']}"] if "blend_runs" in result["meta"] else [])]


#: what a comm run's `--trainer` runs in each rank beside the step
COMM_TRAINERS = {
    "idle": "",
    "python": ", and each rank runs a thread spinning Python (holding the GIL)",
    "dispatch": ", and each rank runs a thread of Python with a tiny torch op every few µs "
                "(giving the GIL up at each)",
    "torch": ", and each rank runs a thread of 1-thread torch matmuls",
}


def section_comm(result: dict[str, Any], docs: str) -> list[str]:
    trainer = result["meta"].get("args", {}).get("trainer", "idle")
    limit = 1.05 if trainer == "idle" else 1.0  # beside a busy trainer: issue 16's bar
    rows = []
    for model in result["models"]:
        for bucket_mb, row in model["buckets"].items():
            rows.append([f"{model['num_params'] / 1e6:.1f}M", f"{bucket_mb}",
                         f"{row['num_buckets']}", f"{row['asynctron_median_s']:.3f}",
                         f"{row['ddp_median_s']:.3f}", f"{row['ratio']:.2f}x "
                         f"{_ok(row['ratio'] <= limit)}", f"{row['compute_median_s']:.3f}",
                         f"{row['asynctron_exposed_median_s'] * 1e3:.0f} / "
                         f"{row['ddp_exposed_median_s'] * 1e3:.0f}",
                         f"{row['loop_worst_delay_s'] * 1e3:.1f}"])
    lines = ["Step = forward + backward + synchronized gradients on 2 gloo ranks; both sides get "
             "the same buckets (a 1 MiB first bucket, then the size shown)"
             + COMM_TRAINERS[trainer] + f". Target: asynctron / DDP <= {limit:.2f}. Exposed: "
             "last gradient hook until synchronized.", ""]
    lines += _table(["model", "bucket MiB", "buckets", "asynctron s", "DDP s",
                     "asynctron / DDP", "compute only s", "exposed ms (ours / DDP)",
                     "loop worst ms"], rows)
    if trainer != "idle":  # one model, one bucket size: the table says it all
        return lines
    _plot_comm(result, os.path.join(docs, "benchmarks_comm.png"))
    return [*lines, "", "![all-reduce overlap](benchmarks_comm.png)"]


def _plot_comm(result: dict[str, Any], path: str) -> None:
    models = result["models"]
    figure, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 3.6))
    for axis, model in zip(axes if len(models) > 1 else [axes], models, strict=True):
        sizes = sorted(model["buckets"], key=float)
        for key, label in (("asynctron_median_s", "asynctron"), ("ddp_median_s", "DDP"),
                           ("compute_median_s", "compute only")):
            axis.plot([float(s) for s in sizes], [model["buckets"][s][key] for s in sizes],
                      marker="o", label=label)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("bucket size (MiB)")
        axis.set_ylabel("step time (s, median)")
        axis.set_title(f"{model['num_params'] / 1e6:.0f}M parameters", fontsize=10)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def section_write(result: dict[str, Any], docs: str) -> list[str]:
    baselines = result["baselines_gb_per_s"]
    raw = baselines["raw pwrite+fsync (1 thread)"]
    best = sorted(result["results"], key=lambda r: -r["median_gb_per_s"])[:10]
    rows = [[str(r["num_bins"]), str(r["num_workers"]), f"{r['item_bytes'] / MiB:g} MiB",
             "O_DIRECT" if r["direct_io"] else "buffered", f"{r['median_gb_per_s']:.2f}",
             f"{r['median_gb_per_s'] / raw:.2f}x", f"{r['worst_loop_delay_ms']:.1f}"]
            for r in best]
    rec = result["recommended"]
    lines = [f"{len(result['results'])} settings, {result['nbytes'] / GiB:.1f} GiB per save, "
             "through the engine's real save path. Baselines (one thread): "
             + ", ".join(f"{k} {v:.2f} GB/s" for k, v in baselines.items()) + ". The ten "
             "fastest:", ""]
    lines += _table(["bins", "threads", "items", "mode", "GB/s", "x raw", "loop worst ms"], rows)
    lines += ["", f"Recommended for this storage: `Engine(num_workers={rec['num_workers']}, "
                  f"num_bins={rec['num_bins']}, direct_io={rec['direct_io']})` "
                  f"({rec['mean_gb_per_s']:.2f} GB/s, geometric mean over item sizes).", "",
              "![write sweep](benchmarks_write.png)"]
    settings = [Result(Setting(r["num_bins"], r["num_workers"], r["item_bytes"],
                               r["direct_io"]), r["median_gb_per_s"], r["samples_s"],
                       r["worst_loop_delay_ms"]) for r in result["results"]]
    plot(settings, baselines, os.path.join(docs, "benchmarks_write.png"),
         f"asynctron save sweep on {result['target']}")
    return lines


def section_dcp(result: dict[str, Any], docs: str) -> list[str]:
    """`dcp.save` and `dcp.async_save` with stock FileSystemWriter and with asynctron.dcp."""
    rows = []
    for t in result["targets"]:
        where = "tmpfs" if t["target"].startswith("/dev/shm") else "disk"
        saves, blocking = t["save_median_s"], t["async_blocking_median_s"]
        stock_blocking = min(v for k, v in blocking.items() if not k.startswith("asynctron"))
        rows.append([where, f"{saves[t['best_stock']]:.3f} s ({t['best_stock']})",
                     f"{saves['asynctron.dcp']:.3f} s", f"{saves['raw pwrite+fsync']:.3f} s",
                     f"{t['save_ratio']:.2f}x {_ok(t['save_ratio'] >= 1.0)}",
                     f"{stock_blocking:.3f} s",
                     f"{blocking['asynctron.dcp async_save']:.3f} s",
                     f"{t['async_blocking_ratio']:.2f}x {_ok(t['async_blocking_ratio'] <= 0.5)}"])
    first = result["targets"][0]
    return [f"{first['nbytes'] / GiB:.2f} GiB state dict, one process, every save fsynced; "
            f"medians of {len(first['samples']['save_s']['asynctron.dcp'])} shuffled rounds. "
            "Save ratio: the best stock thread count's time over asynctron's (target >= 1.0x); "
            "async_save blocking ratio: asynctron's over stock's shortest (target <= 0.5x).", "",
            *_table(["target", "stock dcp.save (best)", "asynctron.dcp", "raw pwrite+fsync",
                     "save ratio", "stock async_save blocks", "asynctron blocks",
                     "blocking ratio"], rows)]


def section_s3(result: dict[str, Any], docs: str) -> list[str]:
    """Checkpoints on one local S3 server: asynctron against the raw client and the peers;
    the client's CPU per GB; a throttling store (issue 36) where the run measured one."""
    ratios = result["ratios"]
    raw = ratios["asynctron_over_raw"]
    lines = [f"{result['nbytes'] / GiB:.2f} GiB state dict ({result['num_tensors']} tensors "
             f"per rank), {result['world_size']} rank(s), one local SeaweedFS; medians of "
             f"{result['meta']['args']['repeats']} rounds, each method in fresh processes. "
             "CPU: the client process's time (every thread) per GB moved.", "",
             *_s3_table(result["methods"]), "",
             f"- save vs raw multipart PUT: {raw['save']:.2f}x {_ok(raw['save'] >= 0.9)} "
             "(target >= 0.9x)",
             f"- load vs raw ranged GET: {raw['load']:.2f}x {_ok(raw['load'] >= 0.9)} "
             "(target >= 0.9x)"]
    if fastest := ratios.get("asynctron_over_fastest_peer"):  # absent when --only left no peer
        lines += [f"- save vs fastest peer ({fastest['save']['peer']}): "
                  f"{fastest['save']['ratio']:.2f}x {_ok(fastest['save']['ratio'] >= 1.0)} "
                  "(target >= 1.0x)",
                  f"- load vs fastest peer ({fastest['load']['peer']}): "
                  f"{fastest['load']['ratio']:.2f}x {_ok(fastest['load']['ratio'] >= 1.5)} "
                  "(target >= 1.5x)"]
    ours = result["methods"].get("asynctron", {})
    if "load_cpu_s_per_gb" in ours:
        lines += [f"- client CPU per GB, load: {ours['load_cpu_s_per_gb']:.2f} s "
                  f"{_ok(ours['load_cpu_s_per_gb'] <= 1.0)} (target <= 1.0 s); save: "
                  f"{ours['save_cpu_s_per_gb']:.2f} s {_ok(ours['save_cpu_s_per_gb'] <= 0.65)} "
                  "(target <= 0.65 s)"]
    if "asynctron_over_raw_one_process" in ratios:
        one = ratios["asynctron_over_raw_one_process"]
        lines += [f"- {result['world_size']} ranks vs one process's raw parallel PUT/GET of the "
                  f"same bytes: save {one['save']:.2f}x {_ok(one['save'] >= 0.9)}, load "
                  f"{one['load']:.2f}x {_ok(one['load'] >= 0.9)} (target >= 0.9x); LIST "
                  f"requests per load, all ranks: {max(ours['load_lists_per_round'])}"]
    if "throttle" in result:
        throttle = result["throttle"]
        cost = throttle["ratios"]["throttled_over_budget_4"]
        lines += ["", f"A throttling store: {throttle['nbytes'] / GiB:.2f} GiB, one process; "
                  f"the server's own S3 circuit breaker answers 503 to every read and write "
                  f"beyond {throttle['limit']} in flight, against the same save with a "
                  f"request budget of {throttle['limit']} and no throttle.", "",
                  *_s3_table(throttle["methods"]), "",
                  f"- throttled save vs budget {throttle['limit']}: {cost['save']:.2f}x "
                  f"{_ok(cost['save'] >= 0.8)} (target >= 0.8x); load {cost['load']:.2f}x"]
        proxied = throttle["ratios"].get("proxy_throttled_over_budget_4")
        if proxied is not None:
            lines += [f"- a proxy answering 503 beyond {throttle['limit']} requests in flight, "
                      f"save vs budget {throttle['limit']} through the same proxy: "
                      f"{proxied['save']:.2f}x {_ok(proxied['save'] >= 0.8)} (target >= 0.8x); "
                      f"load {proxied['load']:.2f}x"]
        for name, m in throttle["methods"].items():
            if "save_throttled_per_round" in m:
                lines += [f"- {name}: 503s per save {m['save_throttled_per_round']} of "
                          f"{m['save_requests_per_round']} requests"]
    return lines


def _s3_table(methods: dict[str, Any]) -> list[str]:
    rows = []
    for name, m in methods.items():
        in_flight = m.get("most_in_flight")
        cpu = (f"{m['save_cpu_s_per_gb']:.2f} / {m['load_cpu_s_per_gb']:.2f}"
               if "save_cpu_s_per_gb" in m else "-")
        loop = f"{m['loop_worst_delay_median_s'] * 1e3:.1f}"
        if "load_loop_worst_delay_median_s" in m:
            loop += f" / {m['load_loop_worst_delay_median_s'] * 1e3:.1f}"
        rows.append([name, f"{m['save_gb_per_s']:.3f}", f"{m['load_gb_per_s']:.3f}", cpu,
                     f"{m['blocking_median_s']:.3f} s", f"{loop} ms",
                     f"{m['save_peak_rss_growth_median_bytes'] / MiB:.0f} MiB",
                     f"{m['load_peak_rss_growth_median_bytes'] / MiB:.0f} MiB",
                     "-" if in_flight is None else str(in_flight)])
    return _table(["method", "save GB/s", "load GB/s", "CPU s/GB save / load", "blocking",
                   "loop worst save / load", "save RSS+", "load RSS+", "in flight"], rows)


def section_s3_restarts(result: dict[str, Any], docs: str) -> list[str]:
    """Every rank of a job loading the same checkpoint from the store at once: each method's
    time to every rank loaded and the bytes it read from the store, per layout."""
    from asynctron.bench import _store_restarts as restarts

    meta = result["meta"]
    args = meta["args"]
    lines = [f"{args['ranks']} ranks as {args['ranks'] // args['ranks_per_node']} nodes, one "
             f"local SeaweedFS; through the `{meta['store_profile']}` profile (a ShapingProxy "
             "per node) and on loopback; medians of "
             f"{args['repeats']} rounds after a warm-up round, each the slowest rank's time "
             "between barriers. Store bytes: what the proxies handed to the job's ranks, "
             "against the state's size.", ""]
    for layout in restarts.LAYOUTS:
        found = result[layout]
        size = found["state_bytes"]
        what = ("data-parallel: every tensor on every rank" if layout == "ddp"
                else "FSDP2: each byte on one rank")
        rows = []
        for method in (*restarts.METHODS, restarts.FLOOR_GETS):
            proxied, loopback = f"{method}, proxied", f"{method}, loopback"
            if proxied not in found["median_s"]:
                continue
            read = found["store_bytes_over_state"].get(proxied)
            rows.append([method, f"{found['median_s'][proxied]:.2f}",
                         f"{found['median_s'][loopback]:.2f}",
                         "-" if read is None else f"{read:.2f}x"])
        lines += [f"**{layout}** ({what}), {size / GiB:.2f} GiB:", "",
                  *_table(["method", "proxied s", "loopback s", "store bytes / state"], rows),
                  ""]
        ratios = found["ratios"]
        for link in ("proxied", "loopback"):
            for key, value in ratios.items():
                if key.endswith(link):
                    lines.append(f"- {key}: {value:.2f}x")
        lines.append("")
    plot = "benchmarks_s3_restarts.png"
    _plot_s3_restarts(result, os.path.join(docs, plot))
    return [*lines, f"![time to every rank loaded]({plot})"]


def _plot_s3_restarts(result: dict[str, Any], path: str) -> None:
    from asynctron.bench import _store_restarts as restarts

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, layout in zip(axes, restarts.LAYOUTS, strict=True):
        median = result[layout]["median_s"]
        names = [f"{method}, {link}" for link in ("proxied", "loopback")
                 for method in restarts.METHODS if f"{method}, {link}" in median]
        colors = ["tab:gray" if name.startswith("floor") else "tab:orange"
                  if name.startswith("asynctron") else "tab:blue" for name in names]
        axis.barh(names, [median[name] for name in names], color=colors)
        axis.invert_yaxis()
        axis.set_xlabel("seconds to every rank loaded (median)")
        axis.set_title(f"{layout} state", fontsize=10)
        axis.tick_params(axis="y", labelsize=7)
    figure.suptitle("a job restarting from the store (orange: asynctron, blue: stock dcp.load, "
                    "gray: raw floor)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def section_data_s3(result: dict[str, Any], docs: str) -> list[str]:
    """Datasets on one local S3 server: asynctron against megatron's S3 reader and local files."""
    from asynctron.bench._data_s3_report import plot

    summary = result["summary"]
    rows = [[label, f"{row['samples_per_s']:,.1f}", f"{row['first_batch_s']:.2f}",
             f"{row['wait_p50_s'] * 1e3:.2f} / {row['wait_p95_s'] * 1e3:.1f} / "
             f"{row['wait_max_s'] * 1e3:.0f}",
             f"{row['fetched_per_used']:.3f}" if "fetched_per_used" in row else "-"]
            for label, row in summary["medians"].items()]
    goals = [f"- {t['what']}: {t['value']:.2f} (target {t['target']}"
             + (")" if t["met"] is None else f") {_ok(t['met'])}") for t in summary["targets"]]
    lines = [f"A {result['corpus_bytes'] / GiB:.2f} GiB uint16 corpus on one local SeaweedFS, "
             f"{result['epoch_samples']:,} samples of {result['sequence_length']} tokens in "
             f"GPTDataset's shuffled order, micro batch {result['micro_batch_size']}; a fresh "
             f"process per run, medians of {result['repeats']} rounds after one whole cold "
             "epoch (whose cache the warm runs read). megatron's runs are bounded in time; "
             "asynctron's cold runs read the first "
             f"{result['meta']['args']['cold_samples']:,} samples, its warm and local runs the "
             "epoch, every run beside the busy trainer the first "
             f"{result['meta']['args']['busy_samples']:,}. Waits: the consumer's, after the "
             "first batch; fetched/used: bytes fetched from the store while reading per byte "
             "of the samples' tokens.", "",
             *_table(["method, trainer", "samples/s", "first batch s",
                      "wait p50 / p95 / max ms", "fetched / used"], rows), "", *goals,
             "- the first {} samples of every method: {}".format(
                 summary["num_verified"], "identical" if summary["samples_match"]
                 else f"DIFFER ({summary['samples_differ']})")]
    lines += [f"- not run: {label}: {reason}" for label, reason in result["not_run"].items()]
    if result.get("cache_series") and plot(result["cache_series"],
                                           os.path.join(docs, "benchmarks_data_s3.png")):
        lines += ["", "![object cache during a cold epoch](benchmarks_data_s3.png)"]
    return lines


def section_tiers(result: dict[str, Any], docs: str) -> list[str]:
    """Tiered checkpoints on FSDP2 state: saves, restores and drains against their baselines
    and peers, the bytes each tier holds (issue 46)."""
    from asynctron.bench.tiers import TARGETS

    median, world = result["median_s"], result["world_size"]
    nbytes, cpu = result["nbytes_per_rank"], result.get("cpu_s", {})
    rows = [[name, f"{value:.3f} s", "" if "trainer" in name
             else f"{nbytes / value / 1e9:.2f}",
             f"{cpu[name] / (nbytes / 1e9):.2f}" if name in cpu else ""]
            for name, value in median.items()]
    plot = f"benchmarks_{'tiers_shm' if result['target'] == '/dev/shm' else 'tiers'}.png"
    _plot_tiers(result, os.path.join(docs, plot))
    lines = [f"{world} ranks as {world // result['ranks_per_node']} nodes of "
             f"{result['ranks_per_node']}, an FSDP2 state of "
             f"{result['state_nbytes'] / GiB:.2f} GiB (AdamW's moments included), local "
             f"tiers on {result['target']}, a local SeaweedFS as the store, reached through a "
             f"proxy per node modelling `{result['store_profile']}`; medians of "
             f"{result['meta']['args']['repeats']} rounds, each the slowest rank's.", "",
             *_table(["measure", "median", "GB/s per rank", "CPU s/GB"], rows), "",
             f"![restores and saves, tiers against their peers]({plot})", ""]
    for name, ratio in result["ratios"].items():
        target = TARGETS.get(name)
        if target is None:
            lines.append(f"- {name}: {ratio:.2f}x")
            continue
        sign, bound = target
        met = ratio <= bound if sign == "<=" else ratio >= bound
        lines.append(f"- {name}: {ratio:.2f}x {_ok(met)} (target {sign} {bound:g}x)")
    held = result["notes"].get("tier bytes", {})
    if held:
        lines += ["", *_table(["state", "size MiB", "each node's tier (x the state)",
                               "replicas in it", "store"], [
            [layout, f"{found['state'] / (1 << 20):.1f}",
             ", ".join(f"{b / found['state']:.2f}" for b in found["local"]),
             ", ".join(f"{b / found['state']:.2f}" for b in found["replicas"]),
             f"{found['store'] / found['state']:.2f}"] for layout, found in held.items()])]
    return lines


def _plot_tiers(result: dict[str, Any], path: str) -> None:
    """Where a restart's time goes, by tier, beside the peers; and the saves."""
    median = result["median_s"]
    groups = {
        "restore": ["restore local", "restore replica", "restore store",
                    "restore store, proxied", "elastic restore from the store",
                    "load_into of the same checkpoint", "nvidia-resiliency-ext restore local",
                    "dcp.load (s3torchconnector), proxied",
                    "dcp.load (FsspecReader, s3fs), proxied", "raw read", "raw send"],
        "save": ["tiers blocking", "plain blocking", "nvidia-resiliency-ext save (blocking)",
                 "tiers committed", "plain committed", "raw write", "raw send"],
    }
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for axis, (title, names) in zip(axes, groups.items(), strict=True):
        names = [name for name in names if name in median]
        ours = ("restore", "tiers", "plain", "elastic", "load_into")
        colors = ["tab:gray" if name.startswith("raw") else "tab:orange"
                  if name.startswith(ours) else "tab:blue" for name in names]
        axis.barh(names, [median[name] for name in names], color=colors)
        axis.invert_yaxis()
        if title == "restore":  # stock DCP through the proxy is 10-100x the rest
            axis.set_xscale("log")
        axis.set_xlabel("seconds (median; the slowest rank"
                        f"{'; log scale' if title == 'restore' else ''})")
        axis.set_title(title, fontsize=10)
        axis.tick_params(axis="y", labelsize=8)
    figure.suptitle(f"tiered checkpoints of FSDP2 state, local tiers on {result['target']} "
                    "(orange: asynctron, blue: peers, gray: raw transfers)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def gpu_check_note() -> list[str]:
    """What the prepared GPU check runs and against which targets (issue 30)."""
    return [
        "The GPU figures come from one command on a GPU machine, `python -m asynctron bench gpu "
        "--quick` in a source checkout (after `pip install -e . --no-deps`, which builds the C "
        "extension): every CUDA test and every CUDA benchmark, each part in its own process "
        "under its own time budget (330 s in all with `--quick`; about 15 minutes without), "
        "then one report, `gpu_report.md` and `gpu_report.json` in "
        "`./asynctron-bench/gpu_<host>_<date>/`, with the device, the versions and every "
        "figure next to its target, met or not. It needs no network; without CUDA it says so "
        "and exits 0 (`--dry-run` prints the plan).", "",
        *_table(["part", "command", "quick budget s", "targets (issue 30)"], [
            ["tests", "`pytest -m gpu` over every test file with `gpu` tests", "70",
             "all pass"],
            ["staging_160", "`asynctron bench cuda --size-gib 4 --tensors 160`", "30",
             "D2H staging >= 0.9x a raw pinned `copy_`"],
            ["staging_2590", "`asynctron bench cuda --size-gib 4` (mixed sizes: 2,590 "
             "tensors)", "35", "D2H staging >= 0.9x; `load_into` GB/s >= 0.9x that of 160 "
             "tensors"],
            ["load", "`asynctron bench cuda --mode load --size-gib 2 --tensors 160`", "75",
             "`load_into` and `asynctron.dcp.StorageReader` >= 0.9x raw pread + H2D, warm and "
             "cold; the plugin >= 1.0x stock `dcp.load` and >= 0.9x `load_into`"],
            ["trainer", "`asynctron bench cuda --mode trainer --layers 16 --saves 2` (~250M "
             "parameters, 2.8 GiB of state; 400M and 4.5 GiB without `--layers`)", "115",
             "blocking <= 0.5x DCP's best zero-overhead `async_save`; step time with a save "
             "in flight <= 1.02x without"]]), "",
        "The trainer mode trains a GPT-like model on the GPU (fp32 master weights, bf16 "
        "autocast, fused AdamW) and checkpoints model and optimizer state every 10 steps "
        "through `Engine.save` on the trainer's event loop, `BackgroundEngine`, DCP "
        "`async_save` with zero-overhead staging (`DefaultStager(StagingOptions(True, True, "
        "True, True))`, kept across saves; one per save on torch 2.11 and 2.12, whose stager "
        "cannot stage twice) in thread and in process mode, DCP's default staging "
        "(in the full check, not with `--quick`) and Megatron-core's async writer where it "
        "imports, one after the other in one process. Every method gets the same loop: the "
        "save is requested after a step, and the trainer waits for it to be staged only "
        "before the next optimizer step (as torchtitan does with zero-overhead "
        "checkpointing); every method ends durable, its files fsynced. *Blocking*: what the "
        "save stalls the trainer; *staged* and *durable*: from the request; step time with a "
        "save in flight against the steps before any save.", "",
        "On a GPU machine lent through the `device` tool (Python 3.12, torch, numpy, uvloop, "
        "xxhash and pytest there, no network), the check is one call: `bash "
        "bench/gpu_device.sh` with `carry: [\".whl\"]` and a `timeout_s` of 480, after, "
        "here, once: `echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps "
        "--only-binary=:all: --python-version 3.12 --implementation cp --platform "
        "manylinux_2_17_x86_64 -d .whl pytest-asyncio==1.5.0 'setuptools>=77'` (add "
        "megatron-core's wheel to compare its writer). The script installs the wheels, builds "
        "the C modules in place, runs `bench gpu --quick` and leaves `gpu_report.md`, "
        "`gpu_report.json` and `gpu_check.tgz` (every part's results and log) in `$OUT`.", "",
        "Without a GPU, the per-tensor cost of the same staging and load code was measured on "
        "CPU tensors made to take it: [benchmarks_many_tensors_cpu_vm_20261127.md]"
        "(benchmarks_many_tensors_cpu_vm_20261127.md)."]


def section_cuda(result: dict[str, Any], docs: str) -> list[str]:
    return [f"{result['device']}: D2H staging {result['d2h_vs_raw']:.2f}x a raw pinned `copy_` "
            f"(target >= 0.9x {_ok(result['d2h_vs_raw'] >= 0.9)}); load into GPU "
            f"{result['h2d_vs_raw']:.2f}x a raw pinned H2D copy.", "", *gpu_check_note()]


_TRAINERS = {"idle": "no trainer", "python": "a trainer thread busy in Python (holds the GIL)",
             "torch": "a trainer thread running 1-thread matmuls (holds a core)"}


def section_train(result: dict[str, Any], docs: str) -> list[str]:
    state = result["state"]
    lines = [f"A save of {state['nbytes'] / GiB:.2f} GiB ({state['num_tensors']} tensors) to "
             "`/dev/shm`, requested on the event loop (the main thread) while a trainer works; "
             "every method warm (asynctron's engine and DCP's stager kept across saves), methods "
             "taking turns, medians of the rounds. *Blocking*: until the trainer may change its "
             "tensors (`await task.staged`; `async_save` returning; Megatron's fork). *Total*: "
             "until durable. *Retained*: the trainer's work rate during the save / in the second "
             "before. *Loop*: the event loop's worst heartbeat delay during the save. torch runs "
             "with one intra-op thread, so the 2-core machine has a core for the trainer and one "
             "for checkpointing. `dcp async_save` runs with a persistent `DefaultStager` (its "
             "best settings; the process mode stages into shared memory); `default stager` is "
             "what `dcp.async_save(sd, checkpoint_id=...)` does, fresh memory each save.", ""]
    for kind in ("idle", "python", "torch"):
        if kind not in result:
            continue
        lines += [f"**{_TRAINERS[kind]}**", ""]
        rows = []
        for name, m in sorted(result[kind].items(), key=lambda kv: kv[1]["blocking_s"]):
            retained = f"{m['retained']:.0%}" if "retained" in m else "–"
            rows.append([name, f"{m['blocking_s']:.3f}", f"{m['total_s']:.3f}", retained,
                         f"{m['loop_worst_delay_s'] * 1e3:.1f}"])
        lines += [*_table(["method", "blocking s", "total s", "retained", "loop ms"], rows), ""]
        ours = result[kind].get("asynctron", {})
        if "blocking_vs_idle" in ours:
            lines.append(f"- asynctron's blocking: {ours['blocking_vs_idle']:.2f}x its idle "
                         f"blocking (target <= 3x {_ok(ours['blocking_vs_idle'] <= 3)})")
            for name, ratio in ours["blocking_vs"].items():
                lines.append(f"- vs {name}: {ratio:.2f}x (target <= 0.5x {_ok(ratio <= 0.5)})")
            lines += [f"- the trainer kept {ours['retained']:.0%} of its work (target >= 90% "
                      f"{_ok(ours['retained'] >= 0.9)})", ""]
    if "gpt" in result:
        lines += ["**the demo's small GPT training on the event loop** (an async trainer; one "
                  "loop turn between steps; a save every 5 steps, each waiting for the one "
                  "before, as torchtitan does)", ""]
        rows = [[name, f"{m['blocking_s']:.3f}", f"{m['total_s']:.3f}",
                 f"{m['step_alone_s'] * 1e3:.1f}", f"{m['step_saving_s'] * 1e3:.1f}",
                 f"{m['step_saving_s'] / m['step_alone_s']:.2f}x"]
                for name, m in result["gpt"].items()]
        lines += [*_table(["method", "blocking s", "total s", "step ms, no saves",
                           "step ms, saving", "ratio"], rows), "",
                  "Here asynctron's *total* counts loop turns, not I/O: after `staged` a save "
                  "needs about ten, and this trainer gives one per step, so a save commits just "
                  "before the next one starts. DCP and Megatron finish on their own thread or "
                  "process.", ""]
    _plot_train(result, os.path.join(docs, "benchmarks_train.png"))
    return [*lines, "![saves inside a busy trainer](benchmarks_train.png)"]


def _plot_train(result: dict[str, Any], path: str) -> None:
    labels = {"idle": "no trainer", "python": "Python trainer", "torch": "torch trainer"}
    kinds = [k for k in labels if k in result]
    busy = [k for k in kinds if k != "idle"]
    methods = sorted({name for k in kinds for name in result[k]})
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.8 / len(methods)
    others = iter(["tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
                   "tab:olive", "tab:cyan", "tab:gray"])
    for i, name in enumerate(methods):
        color = "tab:orange" if name == "asynctron" else next(others)
        shift = (i - len(methods) / 2 + 0.5) * width
        left.bar([x + shift for x in range(len(kinds))],
                 [result[k].get(name, {}).get("blocking_s", 0) for k in kinds], width,
                 label=name, color=color)
        right.bar([x + shift for x in range(len(busy))],
                  [result[k].get(name, {}).get("retained", 0) * 100 for k in busy], width,
                  color=color)
    left.set_xticks(range(len(kinds)), [labels[k] for k in kinds])
    left.set_ylabel("blocking s (median, log scale; lower is better)")
    left.set_yscale("log")
    left.legend(fontsize=7)
    right.set_xticks(range(len(busy)), [labels[k] for k in busy])
    right.set_ylabel("trainer's work kept during the save, %")
    right.axhline(90, color="gray", linestyle="--", linewidth=1)
    figure.suptitle("a 1 GiB save while a trainer works (orange: asynctron; dashed: the 90% "
                    "target)", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def section_many(result: dict[str, Any], docs: str) -> list[str]:
    medians = result["medians_s"]
    rows = [[name, f"{median:.3f}"] for name, median in sorted(medians.items(),
                                                               key=lambda kv: kv[1])]
    lines = [f"{result['num_tensors']:,} tensors of 4 floats (one optimizer entry per "
             "parameter) saved to `/dev/shm`, every method durable; medians.", "",
             *_table(["method", "median s"], rows), ""]
    return [*lines, *[f"- {line}" for line in result["targets"]]]


def section_train_data(result: dict[str, Any], docs: str) -> list[str]:
    rows = []
    for cache, by_trainer in result["medians"].items():
        for trainer, by_method in by_trainer.items():
            for method, row in by_method.items():
                ours = method.startswith("asynctron")
                ratio = row.get("over_best_peer")
                target = ""
                if ours:
                    alone = ratio is None or math.isnan(ratio)  # a paced run: no peers in it
                    passed = alone or ratio >= 1.0
                    if trainer.startswith("python"):
                        passed = (passed and row["wait_p95_s"] <= 0.1
                                  and row.get("retained", 0) >= 0.9)
                    target = ("(no peers run) " if alone else f"{ratio:.2f}x ") + _ok(passed)
                rows.append([cache, trainer, method, f"{row['samples_per_s']:,.0f}",
                             f"{row['wait_p50_s'] * 1e3:.2f} / {row['wait_p95_s'] * 1e3:.1f} / "
                             f"{row['wait_max_s'] * 1e3:.0f}", f"{row['first_batch_s']:.2f}",
                             f"{row['retained']:.1%}" if "retained" in row else "",
                             target])
    meta = result["meta"]["args"]
    lines = [f"A {meta['corpus_mib']} MiB uint16 corpus, {meta['sequence_length']}-token "
             f"samples, micro batch {meta['micro_batch_size']}, {meta['prefetch_mib']} MiB "
             f"prefetch budget, 4 batches ahead; a fresh process per {meta['duration']:.0f} s "
             "run; the consumer takes batches as fast as they come, or, where the trainer says "
             "so, works 10 ms after each (a trainer's step; beside a thread spinning Python, "
             "asynctron only: the peers serve fewer batches than that even greedily). "
             "`python-bound`: the trainer thread bound "
             "to the first CPU and every loader's workers to the others (asynctron's "
             "`worker_cpus`, DataLoader's `worker_init_fn`); elsewhere asynctron runs with its "
             "defaults (workers kept off the busy threads' cores, `worker_cpus=\"away\"`). "
             "`dispatch`: Python with a tiny torch op every few microseconds (each gives the "
             "GIL up, as a GPU trainer's dispatch thread launching kernels does). "
             "Retained: the trainer thread's rate while batches flow / its mean rate alone in a "
             "second before and a second after. Targets: asynctron >= the best peer "
             "everywhere; with a Python trainer also p95 wait <= 100 ms and retained >= 90%.",
             ""]
    return [*lines, *_table(["page cache", "trainer", "method", "samples/s",
                             "wait p50 / p95 / max ms", "first batch s", "trainer retained",
                             "asynctron / best peer"], rows)]


def section_hostile(result: dict[str, Any], docs: str) -> list[str]:
    meta = result["meta"]
    limit_s, limit_mib = meta["time_limit_s"], meta["memory_limit_bytes"] / MiB

    def outcome(text: str) -> str:
        if not text.startswith("refused"):
            return text
        reason = text.split(": ", 2)[-1]
        return "refused (" + (reason.split(": ", 1)[-1][:70]) + ")"

    rows = [[row["file"], row["input"], f"{row['bytes'] / MiB:.0f}", f"{row['seconds']:.2f}",
             f"{row['peak_bytes'] / MiB:.0f}",
             f"{row['seconds_vs_real']:.2f} / {row['peak_vs_real']:.2f}", outcome(row["outcome"]),
             _hostile_target(row, meta)] for row in result["rows"]]
    lines = [f"Each input is read as a load reads it (`read_manifest` on a checkpoint directory), "
             f"in a fresh process, at 16 MiB and as large as the reader admits (`manifest.json` "
             f"<= {meta['manifest_cap_bytes'] / MiB:.0f} MiB, `.metadata` <= "
             f"{meta['metadata_cap_bytes'] / MiB:.0f} MiB). Peak: the read's peak RSS above the "
             f"process's after its imports. x real: time and peak against the costliest real "
             f"metadata of that file and size (the rows named real). Target: refused or loaded "
             f"within {limit_s:g} s and {limit_mib / 1024:g} GiB, or where the real metadata "
             f"itself takes more, within {meta['relative_limit']:g} times what it takes.", ""]
    return [*lines, *_table(["file", "input", "MiB", "s", "peak MiB", "x real (s / peak)",
                             "outcome", "target"], rows)]


def _hostile_target(row: dict[str, Any], meta: dict[str, Any]) -> str:
    if row["within_absolute"]:
        return "met"
    if row["input"].startswith("real "):
        return f"baseline (over {meta['time_limit_s']:g} s or 1 GiB)"
    return f"met (<= {meta['relative_limit']:g}x real)" if row["within_real"] else "NOT MET"


SECTIONS: dict[str, tuple[str, Callable[[dict[str, Any], str], list[str]]]] = {
    "save": ("Checkpoint save and load, one process (issue 2)", section_save),
    "save_ranks2": ("Save across 2 ranks (issue 5)", section_save_ranks),
    "save_ranks4": ("Save across 4 ranks (issue 5)", section_save_ranks),
    "data": ("Datasets against megatron-core (issue 3)", section_data),
    "comm": ("Gradient buckets against PyTorch DDP (issue 4)", section_comm),
    "comm_busy": ("Gradient buckets against DDP, a GIL-busy thread in each rank (issue 16)",
                  section_comm),
    "comm_dispatch": ("Gradient buckets against DDP, a dispatch-like thread in each rank",
                      section_comm),
    "comm_torch": ("Gradient buckets against DDP, a torch-busy thread in each rank (issue 16)",
                   section_comm),
    "write": ("Concurrent write sweep (issue 6)", section_write),
    "cuda": ("CUDA: staging, GPU loads, a GPU trainer (issue 30)", section_cuda),
    "train": ("Checkpoints inside a busy trainer (issue 11)", section_train),
    "many": ("Many small tensors (issue 11)", section_many),
    "train_data": ("Data inside a busy trainer (issue 16)", section_train_data),
    "hostile": ("Hostile checkpoint metadata (issue 15)", section_hostile),
    "dcp": ("Stock DCP through asynctron's plugin (issue 14)", section_dcp),
    "s3": ("Checkpoints on object storage (issue 28)", section_s3),
    "data_s3": ("Datasets on object storage (issue 29)", section_data_s3),
    "s3_restarts": ("A job restarting from the store: each stored byte read once (issue 44)",
                    section_s3_restarts),
    "tiers": ("Tiered checkpoints of FSDP2 state, local tiers on the disk (issue 46)",
              section_tiers),
    "tiers_shm": ("Tiered checkpoints of FSDP2 state, local tiers in memory (issue 46)",
                  section_tiers),
}


def other_reports(docs: str) -> list[str]:
    """Links to the reports written beside this one (`benchmarks_<theme>_<machine>_<date>.md`:
    e.g. a before/after of a change), which `render` does not make."""
    names = sorted(name for name in os.listdir(docs)
                   if name.startswith("benchmarks_") and name.endswith(".md"))
    if not names:
        return []
    return ["Reports beside this one: " + ", ".join(f"[{name}]({name})" for name in names) + ".",
            ""]


def render(results_dir: str, docs: str) -> str:
    """Write `docs/benchmarks.md` (and its plots) from the results in `results_dir`."""
    os.makedirs(docs, exist_ok=True)
    results = {}
    for name, run in RUNS.items():
        path = os.path.join(results_dir, run.result_file)
        if os.path.exists(path):
            with open(path) as f:
                results[name] = json.load(f)
    lines = ["# Benchmarks", "",
             "Generated by `bench/report.py` from the result files `asynctron bench all` wrote "
             "in one results directory; each section names the command that measures it "
             "alone.", "",
             "## Machine", "", *machine(results), "", *other_reports(docs)]
    for name, (title, section) in SECTIONS.items():
        lines += [f"## {title}", "", f"Command: `{COMMANDS[name]}`", ""]
        if name in results:
            meta = results[name].get("meta", {})
            if "date" in meta:
                lines += [f"Measured on {meta['date']}, asynctron {meta['asynctron']}.", ""]
            lines += section(results[name], docs)
        else:
            lines.append("Not run here" + (" (no GPU on this machine)." if name == "cuda"
                                           else "."))
            if name == "cuda":
                lines += ["", "These figures need a GPU run. No GPU was lent to the session "
                          "that wrote the GPU check below (issue 30), so none is recorded "
                          "yet.", "", *gpu_check_note()]
        lines.append("")
    path = os.path.join(docs, "benchmarks.md")
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", help="directory of the scenarios' JSON files")
    parser.add_argument("--docs", default="docs", help="where benchmarks.md and plots go")
    args = parser.parse_args(argv)
    print(render(args.results, args.docs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
