"""`StoreProfile`: how a remote, shared object store looks from ONE node, for `ShapingProxy`.

A profile is the node's bandwidth to the store each way (shared by all its connections),
the bandwidth of one connection, the store's first-byte latency per request, and,
optionally, how many requests the store takes in flight before it answers 503 SlowDown.

    StoreProfile.parse("s3-node")                           # a preset
    StoreProfile.parse("s3-node,first_byte=30ms")           # a preset, overridden
    StoreProfile.parse("bandwidth=1.25GB/s,max_in_flight=64")  # the default preset, overridden
    StoreProfile.parse("loopback")                          # no shaping at all

Published figures the presets come from (one node against the store):
- https://docs.aws.amazon.com/whitepapers/latest/s3-optimizing-performance-best-practices/horizontal-scaling-and-request-parallelization-for-high-throughput.html
  (AWS, "Horizontal Scaling and Request Parallelization for High Throughput"): "Make one
  concurrent request for each 85-90 MB/s of desired network throughput. To saturate a
  10 Gb/s network interface card (NIC), you might use about 15 concurrent requests over
  separate connections", scaling on to 25 and 100 Gb/s NICs.
- https://docs.aws.amazon.com/whitepapers/latest/s3-optimizing-performance-best-practices/timeouts-and-retries-for-latency-sensitive-applications.html
  (AWS): for small requests (under 512 KB) "median latencies are often in the tens of
  milliseconds range"; S3 Standard's first-byte latency is commonly quoted as 100-200 ms.
- https://docs.amazonaws.cn/en_us/AmazonS3/latest/userguide/s3-express-performance.html
  (AWS, S3 Express One Zone): "consistent single-digit millisecond first-byte read and write
  request latencies - up to 10x faster than S3 Standard".
- https://github.com/GoogleCloudPlatform/gcsfuse/blob/master/docs/benchmarks.md (Google,
  Cloud Storage FUSE on an n2-standard-96 with 100 Gb/s, bucket in the VM's region, 128
  reading threads): 128 KB files read in 20.9 ms on average; 1 MB reads of large files
  take 16.5 ms each, 7.7 GiB/s in all (~63 MB/s per thread).

The node's bandwidth in the presets is scaled down to what the proxy can carry on the
benchmark machine (2 cores: see docs/benchmarks.md, "The remote-store profile"), as the
share of N connections at the published per-connection rate: a connection, a request and
its first byte keep their published speed and latency, only the node has fewer connections'
worth of bandwidth (4, where a 10 Gb/s NIC takes ~15).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

__all__ = ["DEFAULT_PRESET", "PRESETS", "StoreProfile"]

_MB = 1_000_000
_RATE = re.compile(r"(?P<number>\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)\s*"
                   r"(?P<prefix>|k|K|M|G|T|Ki|Mi|Gi|Ti)(?P<unit>B|b)/s")
_PREFIXES = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
_DURATION = re.compile(r"(?P<number>\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)\s*(?P<unit>s|ms|us)")
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_NONE = ("none", "unlimited")
_KEYS = ("bandwidth", "up_bandwidth", "down_bandwidth", "connection_bandwidth",
         "first_byte", "max_in_flight")


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreProfile:
    """One node's view of a remote store; every field left out shapes nothing. Validated at
    construction (the error names the field and the value).

    `str(profile)` is a `key=value,...` text that `parse` reads back to an equal profile.
    """

    up_bandwidth_bytes_per_s: float | None = None
    """Client-to-store bytes per second of the whole node, all connections together."""
    down_bandwidth_bytes_per_s: float | None = None
    """Store-to-client bytes per second of the whole node, all connections together."""
    connection_bandwidth_bytes_per_s: float | None = None
    """Bytes per second of one connection, each way (S3: ~85-90 MB/s per request)."""
    first_byte_s: float = 0.0
    """From a request's last byte to its response's first, at least."""
    max_requests_in_flight: int | None = None
    """Requests in flight beyond this are answered 503 SlowDown by the proxy."""

    def __post_init__(self) -> None:
        for name in ("up_bandwidth_bytes_per_s", "down_bandwidth_bytes_per_s",
                     "connection_bandwidth_bytes_per_s"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and math.isfinite(value)
                                          and value > 0):
                raise ValueError(f"StoreProfile.{name}: expected bytes per second > 0 or "
                                 f"None, found {value!r}")
        if not (_is_number(self.first_byte_s) and math.isfinite(self.first_byte_s)
                and self.first_byte_s >= 0):
            raise ValueError(f"StoreProfile.first_byte_s: expected seconds >= 0, found "
                             f"{self.first_byte_s!r}")
        limit = self.max_requests_in_flight
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1):
            raise ValueError(f"StoreProfile.max_requests_in_flight: expected an int >= 1 or "
                             f"None, found {limit!r}")

    @property
    def shapes(self) -> bool:
        """Whether this profile changes anything (False: `loopback`)."""
        return self != StoreProfile()

    @classmethod
    def parse(cls, text: str) -> StoreProfile:
        """A profile from a preset name (`PRESETS`), `key=value` overrides of the default
        preset, or a preset name followed by overrides, comma-separated.

        Keys: `bandwidth` (both ways), `up_bandwidth`, `down_bandwidth`,
        `connection_bandwidth` (rates such as `400MB/s`, `1.25GB/s`, `10Gb/s`, `64MiB/s`, or
        `unlimited`), `first_byte` (`100ms`, `0.1s`, `500us`), `max_in_flight` (an int, or
        `none`).

        Raises:
            ValueError: an unknown preset or key, a key given twice, a value that does not
                read as its key's kind, or a profile that fails validation.
        """
        items = [item.strip() for item in text.split(",")]
        base = DEFAULT_PRESET
        if items and "=" not in items[0]:
            base = items.pop(0)
            if base not in PRESETS:
                raise ValueError(f"store profile {text!r}: expected a preset of "
                                 f"{sorted(PRESETS)} or key=value overrides, found {base!r}")
        changes: dict[str, object] = {}
        seen: set[str] = set()
        for item in items:
            key, equals, value = (part.strip() for part in item.partition("="))
            if not equals or key not in _KEYS:
                raise ValueError(f"store profile {text!r}: expected key=value with a key of "
                                 f"{list(_KEYS)}, found {item!r}")
            if key in seen:
                raise ValueError(f"store profile {text!r}: key {key!r} given twice")
            seen.add(key)
            if key == "first_byte":
                changes["first_byte_s"] = _duration(key, value)
            elif key == "max_in_flight":
                changes["max_requests_in_flight"] = _count(key, value)
            else:
                rate = _rate(key, value)
                names = (("up", "down") if key == "bandwidth" else (key.split("_")[0],))
                changes.update({f"{name}_bandwidth_bytes_per_s": rate for name in names})
        return replace(PRESETS[base], **changes)

    def __str__(self) -> str:
        up, down = self.up_bandwidth_bytes_per_s, self.down_bandwidth_bytes_per_s
        parts = ([f"bandwidth={_format_rate(up)}"] if up == down else
                 [f"up_bandwidth={_format_rate(up)}", f"down_bandwidth={_format_rate(down)}"])
        limit = self.max_requests_in_flight
        return ",".join([
            *parts, f"connection_bandwidth={_format_rate(self.connection_bandwidth_bytes_per_s)}",
            f"first_byte={_format_seconds(self.first_byte_s)}",
            f"max_in_flight={'none' if limit is None else limit}"])


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _rate(key: str, value: str) -> float | None:
    if value.lower() in _NONE:
        return None
    match = _RATE.fullmatch(value)
    if match is None or float(match["number"]) <= 0:
        raise ValueError(f"store profile {key}: expected a rate > 0 such as 400MB/s, "
                         f"1.25GB/s, 10Gb/s or 'unlimited', found {value!r}")
    rate = float(match["number"]) * _PREFIXES[match["prefix"]]
    return rate / 8 if match["unit"] == "b" else rate


def _duration(key: str, value: str) -> float:
    match = _DURATION.fullmatch(value)
    if match is None:
        raise ValueError(f"store profile {key}: expected a duration such as 100ms, 0.1s or "
                         f"500us, found {value!r}")
    return float(match["number"]) * _SECONDS[match["unit"]]


def _count(key: str, value: str) -> int | None:
    if value.lower() in _NONE:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"store profile {key}: expected an int >= 1 or 'none', found "
                         f"{value!r}")
    return int(value)


def _format_rate(rate: float | None) -> str:
    if rate is None:
        return "unlimited"
    for prefix in ("G", "M", "k", ""):
        text = f"{rate / _PREFIXES[prefix]:.12g}"
        if (rate >= _PREFIXES[prefix] or not prefix) and float(text) * _PREFIXES[prefix] == rate:
            return f"{text}{prefix}B/s"
    return f"{rate!r}B/s"


def _format_seconds(seconds: float) -> str:
    text = f"{seconds * 1e3:.12g}"
    return f"{text}ms" if float(text) * 1e-3 == seconds else f"{seconds!r}s"


_S3_CONNECTION_BYTES_PER_S = 88 * _MB
"""AWS: one request per 85-90 MB/s of throughput wanted."""
_NODE_CONNECTIONS = 4
"""The node's share of the store, in connections at the per-connection rate (a 10 Gb/s NIC
takes ~15 at S3's): what the proxy can carry on the 2-core benchmark machine."""
_GCS_CONNECTION_BYTES_PER_S = 63 * _MB
"""Cloud Storage FUSE: 1 MB reads in 16.5 ms each, per thread."""

PRESETS: Mapping[str, StoreProfile] = MappingProxyType({
    "loopback": StoreProfile(),
    "s3-node": StoreProfile(
        up_bandwidth_bytes_per_s=_NODE_CONNECTIONS * _S3_CONNECTION_BYTES_PER_S,
        down_bandwidth_bytes_per_s=_NODE_CONNECTIONS * _S3_CONNECTION_BYTES_PER_S,
        connection_bandwidth_bytes_per_s=_S3_CONNECTION_BYTES_PER_S, first_byte_s=0.1),
    "s3-express-node": StoreProfile(
        up_bandwidth_bytes_per_s=_NODE_CONNECTIONS * _S3_CONNECTION_BYTES_PER_S,
        down_bandwidth_bytes_per_s=_NODE_CONNECTIONS * _S3_CONNECTION_BYTES_PER_S,
        connection_bandwidth_bytes_per_s=_S3_CONNECTION_BYTES_PER_S, first_byte_s=0.005),
    "gcs-node": StoreProfile(
        up_bandwidth_bytes_per_s=_NODE_CONNECTIONS * _GCS_CONNECTION_BYTES_PER_S,
        down_bandwidth_bytes_per_s=_NODE_CONNECTIONS * _GCS_CONNECTION_BYTES_PER_S,
        connection_bandwidth_bytes_per_s=_GCS_CONNECTION_BYTES_PER_S, first_byte_s=0.02),
})
"""The named profiles `StoreProfile.parse` knows (sources in this module's docstring):
- `loopback`: no shaping (the test store as it is).
- `s3-node`: S3 Standard from one node: 88 MB/s per connection, 100 ms to first byte, the
  node 4 connections' worth (352 MB/s) each way.
- `s3-express-node`: the same with S3 Express One Zone's 5 ms to first byte.
- `gcs-node`: Cloud Storage: 63 MB/s per connection, 20 ms to first byte, 4 connections'
  worth (252 MB/s) each way."""

DEFAULT_PRESET = "s3-node"
"""What `key=value` overrides apply to when no preset is named."""
