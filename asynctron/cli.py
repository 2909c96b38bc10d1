"""The `asynctron` command: inspect and verify checkpoints, run the demo trainer, run benchmarks.

Subcommands:
- `inspect PATH`: the manifest as a table (or `--json`); reads the manifest and file sizes only.
- `verify PATH`: re-reads every item and checks its checksum, and decodes every `torch.save`
  blob (stock DCP items, pickled values) as a load would, so it fails wherever a load would. A
  `CheckpointReader` on an `Engine`'s executor reads each file in batched calls into one reused
  buffer per file and hashes as it goes, two files at a time, so memory stays bounded by two
  calls (and the blobs being decoded), where `asynctron.load(path)` would hold the whole
  checkpoint, and every corrupt item is reported, not only the first.
- `demo`: generates a corpus, trains a small GPT on local gloo ranks (async loader, awaitable
  gradient buckets, async checkpoints every K steps), stops half-way, resumes from the newest
  checkpoint, and checks the resumed run repeats an uninterrupted one bit for bit.
- `preprocess --input data.jsonl --output-prefix out --tokenizer byte|tokenizer.json`:
  tokenizes JSON lines into megatron `.bin`/`.idx` files (`out_text_document.*`), like
  megatron's `tools/preprocess_data.py`.
- `prepare-cache CONFIG`: builds every GPT dataset index a JSON config describes into its
  `path_to_cache` (those cached already are kept), like megatron's `tools/prepare_cache.py`, so
  a run can start with `fast_cache_load` and no rank waits on a build; one line per dataset.
- `bench SCENARIO ARGS...`: runs a benchmark of `asynctron.bench` (peers from the `bench`
  extra), e.g. `asynctron bench write --target DIR --quick` on the storage at DIR.

PATH is a checkpoint directory or a root whose `latest` pointer names one.
Exit status: 0 success; 1 corrupt checkpoint or dataset, or failed round trip; 2 not found,
unreadable, or bad usage (a bad config).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import sys
from collections.abc import Callable

import uvloop
from tqdm import tqdm

from asynctron import __version__
from asynctron._demo import (
    DemoConfig,
    DemoReport,
    disk_nbytes,
    fresh_output_dir,
    remove_output_dir,
    run_demo,
)
from asynctron._knobs import STORE_DEADLINE_S, store_deadline_flag
from asynctron.bench import SCENARIOS
from asynctron.datasets import PreparedDataset, PreprocessConfig, prepare_cache, preprocess
from asynctron.engine import Engine
from asynctron.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    CorruptDatasetError,
    StorageError,
)
from asynctron.storage import ItemRecord, Manifest, backend_for, store_operation
from asynctron.storage.backends import CheckpointReader, ItemReader
from asynctron.storage.format import ReadJob, decode_blob, tensor_of, value_paths


def main(argv: list[str] | None = None) -> int:
    """Run the `asynctron` command line with `argv` (default: `sys.argv[1:]`); returns the exit
    status. Bad usage exits 2 through argparse; a bad path or URL is one line, exit 2."""
    args = _parser().parse_args(argv)
    try:
        if args.command in ("inspect", "verify"):
            with store_deadline_flag("--deadline-s", args.deadline_s):
                return args.run(args)
        return args.run(args)
    except CorruptCheckpointError as exc:
        print(f"asynctron {args.command}: {exc}", file=sys.stderr)
        return 1
    except (CheckpointNotFoundError, StorageError) as exc:
        print(f"asynctron {args.command}: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a path no backend serves, a malformed URL
        if args.command not in ("inspect", "verify"):
            raise
        print(f"asynctron {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `asynctron inspect ... | head`: the reader went away
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 1


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, found {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, found {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asynctron", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    inspect = commands.add_parser("inspect", help="print a checkpoint's items and values")
    inspect.add_argument("path", help="a checkpoint directory or a root with a `latest` pointer")
    inspect.add_argument("--json", action="store_true",
                         help="print the checkpoint, its items and values as JSON")
    inspect.set_defaults(run=_inspect)

    verify = commands.add_parser("verify", help="check every item's checksum")
    verify.add_argument("path", help="a checkpoint directory or a root with a `latest` pointer")
    verify.set_defaults(run=_verify)
    for command in (inspect, verify):
        command.add_argument("--deadline-s", type=_seconds, default=None, metavar="S",
                             help="on an object store: fail once it has answered nothing "
                                  f"for S seconds (default: ${STORE_DEADLINE_S}, else 60)")

    demo = commands.add_parser("demo", help="train a small GPT on local ranks with async "
                                            "data, gradients and checkpoints; resume it")
    demo.add_argument("--out", help="directory for the corpus and checkpoints (new or empty), "
                                    "kept after the run; default: a fresh "
                                    "./demo-out/<timestamp>-*, removed once the run passes")
    demo.add_argument("--nproc", type=_positive_int, default=2, help="data-parallel ranks")
    demo.add_argument("--steps", type=_positive_int, default=40,
                      help="steps of the uninterrupted run (the first run stops half-way)")
    demo.add_argument("--save-every", type=_positive_int, default=10, metavar="K",
                      help="save after every K-th step")
    demo.add_argument("--hidden", type=_positive_int, default=256, help="model width")
    demo.add_argument("--layers", type=_positive_int, default=4, help="decoder blocks")
    demo.add_argument("--seq-len", type=_positive_int, default=64, help="tokens per sample")
    demo.add_argument("--batch", type=_positive_int, default=8, help="samples per rank per step")
    demo.add_argument("--keep-last", type=_positive_int, default=None, metavar="N",
                      help="keep only the N newest checkpoints (default: all)")
    demo.add_argument("--nodes", type=int, default=2,
                      help="nodes of the node-loss run, whose last node is lost mid-run and "
                           "its ranks restored from replicas (0: skip that run)")
    demo.add_argument("--ranks-per-node", type=_positive_int, default=2,
                      help="ranks per node in the node-loss run")
    demo.set_defaults(run=_demo)

    prep = commands.add_parser("preprocess", help="tokenize JSON lines into .bin/.idx files")
    prep.add_argument("--input", required=True, help="a JSON-lines file")
    prep.add_argument("--output-prefix", required=True,
                      help="outputs are <prefix>_<key>_document.bin/.idx")
    prep.add_argument("--tokenizer", default="byte",
                      help="`byte` (no download) or the path of a local tokenizer.json")
    prep.add_argument("--eod-token", default=None,
                      help="the end-of-document token of a tokenizer.json")
    prep.add_argument("--json-keys", nargs="+", default=["text"],
                      help="keys whose text is tokenized (one dataset each)")
    prep.add_argument("--append-eod", action="store_true",
                      help="end each document with the end-of-document token")
    prep.add_argument("--workers", type=_positive_int, default=1, help="tokenizing processes")
    prep.set_defaults(run=_preprocess)

    cache = commands.add_parser("prepare-cache", help="build the GPT dataset indices of a "
                                                      "config into its cache, offline")
    cache.add_argument("config", help='a JSON file: {"sizes": [train, valid, test], "config": '
                                      "{GPTDatasetConfig fields, with eod_id/pad_id for the "
                                      "tokenizer and path_to_cache}}")
    cache.set_defaults(run=_prepare_cache)

    width = max(map(len, SCENARIOS))
    bench = commands.add_parser(
        "bench", help="run a benchmark on this machine",
        description="Run a benchmark on this machine: asynctron and its peers in one run, "
                    "printed as\nratios and written as JSON. `asynctron bench SCENARIO --help` "
                    "lists a scenario's\noptions.",
        epilog="scenarios:\n" + "\n".join(f"  {name:<{width}}  {scenario.summary}"
                                           for name, scenario in sorted(SCENARIOS.items())),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("scenario", choices=sorted(SCENARIOS), metavar="SCENARIO",
                       help="one of the scenarios below")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the scenario")
    bench.set_defaults(run=_bench)
    return parser


# inspect ---------------------------------------------------------------------------------------

def format_nbytes(nbytes: int) -> str:
    """`nbytes` for people: `512 B`, `4.0 KiB`, `1.5 GiB`."""
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _inspect(args: argparse.Namespace) -> int:
    path, manifest = uvloop.run(_read_manifest(args.path))
    values = value_paths(manifest.structure)
    if args.json:  # an item a line, so large checkpoints stay readable and greppable
        head = json.dumps({"checkpoint": path, "requested": args.path,
                           "created_unix_s": manifest.created_unix_s, "values": values})
        items = ",\n  ".join(json.dumps(dataclasses.asdict(item)) for item in manifest.items)
        print(f'{head[:-1]},\n "items": [\n  {items}\n]}}' if items else f'{head[:-1]}, '
              '"items": []}')
        return 0
    header = ("key", "kind", "dtype", "shape", "nbytes", "file", "offset")
    rows = [(item.key, item.kind, item.dtype or "-",
             "-" if item.shape is None else str(list(item.shape)),
             format_nbytes(item.nbytes), item.file, str(item.offset))
            for item in manifest.items]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    right = {4, 6}  # numbers
    followed = "" if _same_path(path, args.path) else f" (named by {args.path}'s latest)"
    print(f"checkpoint {path}{followed}")
    for row in [header, *rows]:
        print("  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                        for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip())
    if values:
        width = max(len(key) for key in values)
        print("values:")
        for key, value in values.items():
            print(f"  {key.ljust(width)}  {json.dumps(value)}")
    created = datetime.datetime.fromtimestamp(manifest.created_unix_s).astimezone()
    print(f"{len(manifest.items)} items, {format_nbytes(manifest.nbytes)} ({manifest.nbytes} "
          f"bytes) in {len(manifest.files)} files, {len(values)} values, created "
          f"{created.isoformat(timespec='seconds')}")
    return 0


def _same_path(resolved: str, requested: str) -> bool:
    """Whether the checkpoint read is the one asked for (not one its `latest` named)."""
    if "://" in requested:
        return resolved.rstrip("/") == requested.rstrip("/")
    return os.path.abspath(resolved) == os.path.abspath(requested)


async def _read_manifest(path: str) -> tuple[str, Manifest]:
    """The checkpoint at `path` (or the one `path/latest` names) and its validated manifest."""
    async with Engine(num_workers=1) as engine:
        with store_operation("inspect", path):
            reader = await _open_reader(engine, path)
            try:
                manifest = await reader.open()  # first: it follows `latest`
                return reader.path, manifest
            finally:
                await reader.aclose()


async def _open_reader(engine: Engine, path: str) -> CheckpointReader:
    backend = backend_for(path)
    return await backend.checkpoints(engine.run_blocking).open_reader(
        backend.locate(path), max_files_at_once=engine.config.num_workers)


# verify ----------------------------------------------------------------------------------------

def _verify(args: argparse.Namespace) -> int:
    path, manifest, failures = uvloop.run(verify_checkpoint(args.path))
    for failure in failures:
        print(f"asynctron verify: {failure}", file=sys.stderr)
    if failures:
        print(f"checkpoint {path}: {len(failures)} of {len(manifest.items)} items corrupt")
        return 1
    num_blobs = sum(record.encoding == "torch_save" for record in manifest.items)
    decoded = f"; {num_blobs} torch.save items decode" if num_blobs else ""
    if manifest.checksum is None:
        print(f"checkpoint {path}: saved without checksums{decoded or '; nothing to verify'}")
        return 0
    print(f"checkpoint {path}: {len(manifest.items)} items, {format_nbytes(manifest.nbytes)} in "
          f"{len(manifest.files)} files: {manifest.checksum} ok{decoded}")
    return 0


async def verify_checkpoint(path: str) -> tuple[str, Manifest, list[CorruptCheckpointError]]:
    """Check every item of the checkpoint at `path` as a load would: read it and check its
    checksum, and decode each `torch.save` blob (stock DCP items, pickled values) with the
    checks a load makes (`decode_blob`, `tensor_of`), so verify fails wherever load would.

    Returns:
        the resolved checkpoint path, its manifest, and one error per corrupt item.

    Raises:
        CheckpointNotFoundError: nothing committed at `path`.
        CorruptCheckpointError: a bad manifest or a file of the wrong size (nothing is read).
        StorageError: a file could not be opened or read.

    Memory: one buffer of `slab_bytes` per data file being read, two files at a time; then
    `torch.save` blobs read and decoded about `slab_bytes` at a time (a larger blob alone).
    """
    async with Engine(num_workers=2) as engine:
        with store_operation("verify", path):
            reader = await _open_reader(engine, path)
            try:
                manifest = await reader.open()
                blobs = [record for record in manifest.items if record.encoding == "torch_save"]
                with tqdm(total=manifest.nbytes, unit="B", unit_scale=True, unit_divisor=1024,
                          desc="verify", file=sys.stderr, disable=None) as progress:
                    failures = await reader.read(
                        [ReadJob(record, None) for record in manifest.items
                         if record.encoding == "raw"], verify=True,
                        slab_bytes=engine.config.slab_bytes, progress=progress.update)
                    for batch in _batches(blobs, engine.config.slab_bytes):
                        failures += await _decode_blobs(reader, engine, batch, progress.update)
            finally:
                await reader.aclose()
    return reader.path, manifest, failures


def _batches(records: list[ItemRecord], nbytes: int) -> list[list[ItemRecord]]:
    """`records` in runs of about `nbytes` (a larger record alone)."""
    batches: list[list[ItemRecord]] = [[]]
    total = 0
    for record in records:
        if batches[-1] and total + record.nbytes > nbytes:
            batches.append([])
            total = 0
        batches[-1].append(record)
        total += record.nbytes
    return [batch for batch in batches if batch]


async def _decode_blobs(reader: ItemReader, engine: Engine, records: list[ItemRecord],
                        progress: Callable[[int], None]) -> list[CorruptCheckpointError]:
    """Read `records` (checksummed where they have digests), then decode each in the engine's
    executor; one error per item that fails either."""
    buffers = [bytearray(record.nbytes) for record in records]
    failures = await reader.read([ReadJob(record, memoryview(buffer))
                                  for record, buffer in zip(records, buffers, strict=True)],
                                 verify=True, slab_bytes=engine.config.slab_bytes,
                                 progress=progress)
    failed = {(error.key, error.offset) for error in failures}
    for record, buffer in zip(records, buffers, strict=True):
        if (record.key, record.offset) not in failed:
            error = await engine.run_blocking(_decode, record, buffer, reader.file_path(record))
            if error is not None:
                failures.append(error)
    return failures


def _decode(record: ItemRecord, buffer: bytearray, path: str) -> CorruptCheckpointError | None:
    """Blocks: decode a `torch.save` blob as a load does; the error it would raise, or None."""
    try:
        value = decode_blob(memoryview(buffer), key=record.key, path=path)
        if record.kind == "tensor":
            tensor_of(value, record, path)
    except CorruptCheckpointError as error:
        return error
    return None


# demo ------------------------------------------------------------------------------------------

def _demo(args: argparse.Namespace) -> int:
    keep = args.out is not None  # the user's own directory stays; the default one goes
    out = args.out or fresh_output_dir()
    if os.path.isdir(out) and os.listdir(out):
        print(f"asynctron demo: output directory {out!r}: expected a new or empty directory, "
              f"found {len(os.listdir(out))} entries; pass a fresh --out", file=sys.stderr)
        return 2
    try:
        config = DemoConfig(out=out, num_ranks=args.nproc, num_steps=args.steps,
                            save_every=args.save_every, hidden=args.hidden,
                            num_layers=args.layers, sequence_length=args.seq_len,
                            micro_batch_size=args.batch, keep_last=args.keep_last,
                            num_nodes=args.nodes, ranks_per_node=args.ranks_per_node)
    except ValueError as exc:
        if not keep:
            remove_output_dir(out)
        print(f"asynctron demo: {exc}", file=sys.stderr)
        return 2
    print(f"asynctron demo: {config.num_ranks} ranks, {config.num_steps} steps, checkpoints "
          f"every {config.save_every}; writing to {out}"
          f"{'' if keep else ' (removed once the run passes; --out DIR keeps it)'}", flush=True)
    try:
        report = run_demo(config)
    except BaseException:
        print(f"asynctron demo: output kept in {out} "
              f"({format_nbytes(disk_nbytes(out))}), for a look", file=sys.stderr)
        raise
    for line in demo_summary(report):
        print(line)
    passed = report.mismatch is None
    print(_demo_output(out, keep=keep, passed=passed))
    return 0 if passed else 1


def _demo_output(out: str, *, keep: bool, passed: bool) -> str:
    """Where the demo's output is and how large; the default directory removed if it passed."""
    size = format_nbytes(disk_nbytes(out))
    if keep:
        return (f"output: {size} in {out}, kept (its checkpoints: `asynctron inspect "
                f"{os.path.join(out, 'checkpoints')}`)")
    if not passed:
        return f"output: {size} kept in {out}, for a look at the failed run"
    remove_output_dir(out)
    return (f"output: {size} in {out} (corpus, checkpoints, tiers), removed; --out DIR "
            f"keeps it")


def demo_summary(report: DemoReport) -> list[str]:
    """The demo's report, for people: speed, what checkpoints cost training, the resume."""
    config, runs = report.config, report.runs
    first, resumed = runs[0]["first"], runs[0]["resumed"]
    params = (f"{first.num_params / 1e6:.1f}M" if first.num_params >= 100_000
              else f"{first.num_params / 1e3:.0f}K")
    lines = [f"corpus: {config.num_documents} documents, generated and preprocessed in "
             f"{report.corpus_s:.1f} s; model: GPT, {params} parameters"]
    for name, run in (("first run", first), ("resumed run", resumed)):
        last = run.first_step + len(run.losses) - 1
        nbytes = sum(r[name.split()[0]].saved_bytes for r in runs)
        lines.append(
            f"{name} (steps {run.first_step}-{last}): {len(run.losses) / run.train_s:.1f} "
            f"steps/s, data wait {run.data_wait_s:.3f} s; {run.num_saves} checkpoints "
            f"({format_nbytes(nbytes)}, all ranks): training blocked {run.blocked_s:.3f} s of "
            f"{run.checkpoint_s:.3f} s in flight (request -> committed)")
    measured = [r[n] for r in runs for n in ("first", "resumed")]
    worst = max(run.worst_loop_delay_s for run in measured)
    slowest = max(measured, key=lambda run: run.longest_math_s)
    lines.append(f"event loop: worst delay {worst * 1e3:.1f} ms outside the steps' math (the "
                 f"loader, the all-reduces, the checkpoints, other processes taking the CPUs)")
    lines.append(f"steps' math (forward, backward, optimizer): on the event loop's thread, as in "
                 f"any async trainer; the longest held it {slowest.longest_math_s * 1e3:.1f} "
                 f"ms, computing for {slowest.longest_math_cpu_s * 1e3:.1f} ms and waiting for a "
                 f"CPU the rest ({config.num_ranks} ranks and their loader workers on "
                 f"{os.cpu_count()} CPUs here)")
    mismatch = report.mismatch
    if mismatch is not None:
        lines.append(f"resume: FAILED: {mismatch}")
    else:
        losses = runs[0]["reference"].losses
        lines.append(f"resume: bit-identical: steps {resumed.first_step}-{config.num_steps} "
                     f"repeat the uninterrupted run's losses exactly on all {config.num_ranks} "
                     f"ranks (loss {losses[0]:.3f} -> {losses[-1]:.3f})")
    if report.node_loss:
        lines.extend(_node_loss_summary(report, mismatch is None))
    lines.append(f"done in {report.total_s:.1f} s")
    return lines


def _node_loss_summary(report: DemoReport, exact: bool) -> list[str]:
    """The node-loss run, for people: what was lost, where each rank restored from, whether the
    resumed run repeats the uninterrupted one."""
    config, runs = report.config, report.node_loss
    resumed = runs[0]["resumed"]
    world = config.num_nodes * config.ranks_per_node
    lost = config.num_nodes - 1
    sources = resumed.restored_from
    groups = {source: [str(r) for r, s in enumerate(sources) if s == source]
              for source in dict.fromkeys(sources)}
    by_source = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)} from "
                          f"{source}" for source, ranks in groups.items())
    lines = [f"node loss: {world} ranks as {config.num_nodes} nodes of {config.ranks_per_node}, "
             f"the model under FSDP2 (fully_shard), saving to tiers (each node's local tier, a "
             f"replica on the next node, a store); "
             f"node {lost} lost after step {config.lost_at_step} (its ranks SIGKILLed, its "
             f"local tier deleted); restarted on a fresh node: restored step "
             f"{resumed.first_step - 1} in {resumed.restore_s:.2f} s ({by_source})"]
    if exact:
        lines.append(f"node loss: bit-identical: steps {resumed.first_step}-{config.num_steps} "
                     f"repeat the uninterrupted {world}-rank run's losses exactly on all "
                     f"{world} ranks")
    return lines


# preprocess ------------------------------------------------------------------------------------

def _preprocess(args: argparse.Namespace) -> int:
    try:
        config = PreprocessConfig(input=args.input, output_prefix=args.output_prefix,
                                  tokenizer=args.tokenizer, eod_token=args.eod_token,
                                  json_keys=tuple(args.json_keys), append_eod=args.append_eod,
                                  num_workers=args.workers)
        result = preprocess(config)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"asynctron preprocess: {exc}", file=sys.stderr)
        return 2
    for key, prefix in result.output_prefixes.items():
        print(f"{key}: {prefix}.bin, {prefix}.idx")
    print(f"{result.num_documents} documents, {result.num_tokens} tokens in "
          f"{result.elapsed_s:.2f} s")
    return 0


# prepare-cache ---------------------------------------------------------------------------------

def _prepare_cache(args: argparse.Namespace) -> int:
    try:
        report = prepare_cache(args.config, on_dataset=_print_prepared)
    except CorruptDatasetError as exc:
        print(f"asynctron prepare-cache: {exc}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as exc:  # PrepareCacheConfigError is a ValueError
        print(f"asynctron prepare-cache: {exc}", file=sys.stderr)
        return 2
    built = sum(d.built for d in report.datasets)
    print(f"{built} built, {len(report.datasets) - built} already cached, in "
          f"{report.elapsed_s:.2f} s: {report.path_to_cache}")
    return 0


def _print_prepared(dataset: PreparedDataset) -> None:
    done = "built" if dataset.built else "cached"
    print(f"{dataset.split:<5} {dataset.class_name:<16} {dataset.num_samples:>13,} samples  "
          f"{done:<6} {dataset.seconds:8.2f} s", flush=True)


# bench -----------------------------------------------------------------------------------------

def _bench(args: argparse.Namespace) -> int:
    module_name = f"asynctron.bench.{SCENARIOS[args.scenario].module}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(f"asynctron bench {args.scenario}: {module_name} needs {exc.name!r}, which is not "
              "installed; `pip install asynctron[bench]` installs every benchmark's peers",
              file=sys.stderr)
        return 2
    scenario_main: Callable[[list[str]], int] = module.main
    return scenario_main(args.args)
