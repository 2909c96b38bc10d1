"""Plot a save_throughput JSON result: GB/s per method and scenario (a PNG for docs/)."""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")  # headless; must precede the pyplot import
import matplotlib.pyplot as plt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", help="bench/results/save_throughput_*.json")
    parser.add_argument("--out", default="docs/save_throughput.png")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    scenarios = results["scenarios"]
    figure, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 4.6),
                                sharey=False)
    for axis, scenario in zip(axes, scenarios, strict=True):
        names = list(scenario["saves"])
        speeds = [scenario["saves"][n]["gb_per_s"] for n in names]
        colors = ["tab:orange" if n.startswith("asynctron") else
                  "tab:gray" if n.startswith("raw") else "tab:blue" for n in names]
        axis.barh(names, speeds, color=colors)
        axis.invert_yaxis()
        axis.set_title(f"{scenario['label']} ({scenario['nbytes'] / 2**30:.1f} GiB)", fontsize=10)
        axis.set_xlabel("GB/s (median)")
        axis.tick_params(axis="y", labelsize=8)
    meta = results["meta"]
    figure.suptitle(f"save throughput, {meta['cpu_count']} cores, {meta['date']}", fontsize=11)
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
