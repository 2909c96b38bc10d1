"""A self-check of the save benchmark's peers (`_peers`) and physical baselines (`_baselines`).

Each function runs twice on a ~64 MiB state dict (`--mib`); its round trip is verified and its
times are printed. Run ``python -m asynctron.bench._peers_check``; megatron's writer re-imports
``__main__`` (see `_peers`), so this module keeps its work under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time
from collections.abc import Callable

import numpy as np
import safetensors.torch
import torch

from asynctron.bench import _results
from asynctron.bench._baselines import (
    MIB,
    StateDict,
    evict_page_cache,
    flatten_state_dict,
    make_memcpy_destinations,
    make_read_buffers,
    make_state_dict,
    raw_memcpy,
    raw_pwrite_fsync,
    raw_read,
    state_dict_buffers,
)
from asynctron.bench._peers import (
    load_dcp,
    megatron_available,
    peer_versions,
    save_dcp,
    save_dcp_async,
    save_megatron_async,
    save_safetensors,
    save_torch,
)


def _assert_equal(expected: StateDict, actual: StateDict, label: str) -> None:
    want, got = flatten_state_dict(expected), flatten_state_dict(actual)
    if want.keys() != got.keys():
        raise AssertionError(f"{label}: keys differ: {sorted(want.keys() ^ got.keys())[:5]}")
    bad = [name for name in want if not torch.equal(want[name], got[name])]
    if bad:
        raise AssertionError(f"{label}: tensors differ after the round trip: {bad[:5]}")


def _self_check(base: str, total_mib: int) -> None:
    """Run every function on a ~``total_mib`` MiB state dict, verify and print timings."""
    started = time.perf_counter()
    state_dict = make_state_dict(total_mib * MIB, seed=0, large_tensor_bytes=total_mib * MIB // 4)
    buffers = state_dict_buffers(state_dict)
    nbytes = sum(buffer.nbytes for buffer in buffers)
    print(
        f"state dict: {len(state_dict)} tensors, {nbytes / MIB:.1f} MiB, "
        f"built in {time.perf_counter() - started:.2f} s; versions {peer_versions()}"
    )
    print(f"{'function':<22}{'1st ms':>10}{'2nd ms':>10}{'2nd GB/s':>10}")

    def report(label: str, seconds: list[float]) -> None:
        print(
            f"{label:<22}{seconds[0] * 1e3:>10.1f}{seconds[1] * 1e3:>10.1f}"
            f"{nbytes / seconds[1] / 1e9:>10.2f}"
        )

    def timed_twice(label: str, run: Callable[[str], None], suffix: str = "") -> str:
        """Run ``run(target)`` on two fresh targets; return the second target."""
        seconds = []
        for attempt in (1, 2):
            target = os.path.join(base, f"{label}-{attempt}{suffix}")
            begin = time.perf_counter()
            run(target)
            seconds.append(time.perf_counter() - begin)
        report(label, seconds)
        return target

    flat_path = timed_twice("raw_pwrite_fsync", lambda t: raw_pwrite_fsync(buffers, t), ".bin")
    evict_page_cache([flat_path])
    read_buffers = make_read_buffers([flat_path])
    read_seconds = []
    for _attempt in (1, 2):
        begin = time.perf_counter()
        raw_read([flat_path], read_buffers)
        read_seconds.append(time.perf_counter() - begin)
    report("raw_read", read_seconds)
    if not np.array_equal(read_buffers[0], np.concatenate(buffers)):
        raise AssertionError("raw_pwrite_fsync/raw_read: file bytes differ from the buffers")

    destinations = make_memcpy_destinations(buffers)
    copy_seconds = []
    for _attempt in (1, 2):
        begin = time.perf_counter()
        raw_memcpy(buffers, destinations)
        copy_seconds.append(time.perf_counter() - begin)
    report("raw_memcpy", copy_seconds)
    if not all(map(np.array_equal, buffers, destinations)):
        raise AssertionError("raw_memcpy: destinations differ from the sources")

    path = timed_twice("save_torch", lambda t: save_torch(state_dict, t), ".pt")
    _assert_equal(state_dict, torch.load(path, weights_only=True), "save_torch")

    def template() -> dict[str, torch.Tensor]:
        return {name: torch.zeros_like(tensor) for name, tensor in state_dict.items()}

    for label, run in (
        ("save_dcp", lambda t: save_dcp(state_dict, t, thread_count=2)),
        ("save_dcp_async", lambda t: save_dcp_async(state_dict, t, thread_count=2)),
    ):
        directory = timed_twice(label, run)
        loaded = template()
        load_dcp(loaded, directory)
        _assert_equal(state_dict, loaded, label)

    path = timed_twice("save_safetensors", lambda t: save_safetensors(state_dict, t), ".st")
    _assert_equal(state_dict, safetensors.torch.load_file(path), "save_safetensors")
    weight = next(t for t in state_dict.values() if t.dim() == 2)
    awkward = {"nested": {"w": weight, "w_t": weight.t(), "tied": weight}}
    awkward_path = os.path.join(base, "awkward.st")
    save_safetensors(awkward, awkward_path)
    _assert_equal(awkward, safetensors.torch.load_file(awkward_path), "save_safetensors nested")

    reason = megatron_available()
    if reason is None:
        directory = timed_twice("save_megatron_async", lambda t: save_megatron_async(state_dict, t))
        loaded = template()
        load_dcp(loaded, directory)
        _assert_equal(state_dict, loaded, "save_megatron_async")
    else:
        print(f"save_megatron_async: skipped: {reason}")

    async_runs: list[tuple[str, Callable[[str, Callable[[], None]], None]]] = [
        ("save_dcp_async", lambda t, cb: save_dcp_async(state_dict, t, 2, on_staged=cb)),
    ]
    if reason is None:
        async_runs.append(
            ("save_megatron_async", lambda t, cb: save_megatron_async(state_dict, t, on_staged=cb))
        )
    staged_at: list[float] = []

    def mark_staged() -> None:
        staged_at.append(time.perf_counter())

    for label, run in async_runs:
        staged_at.clear()
        begin = time.perf_counter()
        run(os.path.join(base, f"{label}-staged"), mark_staged)
        total = time.perf_counter() - begin
        print(f"{label}: blocking {(staged_at[0] - begin) * 1e3:.1f} ms of {total * 1e3:.1f} ms")
    evict_page_cache([base])
    print("all peers round-tripped")


def main() -> None:
    """Command line for the self-check."""
    parser = argparse.ArgumentParser(description=_results.description(__doc__))
    parser.add_argument(
        "--dir",
        default="/dev/shm" if os.path.isdir("/dev/shm") else None,
        help="where to make the scratch directory (default /dev/shm)",
    )
    parser.add_argument("--mib", type=int, default=64, help="state dict size in MiB")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    base = _results.scratch_dir("asynctron-peers-", args.dir)
    try:
        _self_check(base, args.mib)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
