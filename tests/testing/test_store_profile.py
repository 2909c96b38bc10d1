"""StoreProfile: presets, the text form, and the errors that name the bad field."""

from __future__ import annotations

import pytest

from asynctron.testing.store_profile import DEFAULT_PRESET, PRESETS, StoreProfile


def test_the_default_preset_is_one_s3_node() -> None:
    profile = StoreProfile.parse(DEFAULT_PRESET)
    assert DEFAULT_PRESET == "s3-node"
    assert profile == StoreProfile(up_bandwidth_bytes_per_s=352e6,
                                   down_bandwidth_bytes_per_s=352e6,
                                   connection_bandwidth_bytes_per_s=88e6, first_byte_s=0.1)


def test_loopback_shapes_nothing() -> None:
    assert StoreProfile.parse("loopback") == StoreProfile()
    assert not StoreProfile.parse("loopback").shapes
    assert all(profile.shapes for name, profile in PRESETS.items() if name != "loopback")


def test_overrides_apply_to_the_named_preset_or_the_default() -> None:
    assert StoreProfile.parse("bandwidth=1.25GB/s,first_byte=30ms,max_in_flight=64") == \
        StoreProfile(up_bandwidth_bytes_per_s=1.25e9, down_bandwidth_bytes_per_s=1.25e9,
                     connection_bandwidth_bytes_per_s=88e6, first_byte_s=0.03,
                     max_requests_in_flight=64)
    gcs = StoreProfile.parse(" gcs-node , up_bandwidth = 10Gb/s , connection_bandwidth=unlimited")
    assert gcs.up_bandwidth_bytes_per_s == 1.25e9
    assert gcs.down_bandwidth_bytes_per_s == PRESETS["gcs-node"].down_bandwidth_bytes_per_s
    assert gcs.connection_bandwidth_bytes_per_s is None
    assert gcs.first_byte_s == PRESETS["gcs-node"].first_byte_s


@pytest.mark.parametrize(("text", "bytes_per_s"), [
    ("400MB/s", 400e6), ("64MiB/s", 64 << 20), ("10Gb/s", 1.25e9), ("1.5kB/s", 1500.0),
    ("2e3B/s", 2000.0), (".5GiB/s", 1 << 29), ("unlimited", None), ("None", None)])
def test_rates_read_with_their_units(text: str, bytes_per_s: float | None) -> None:
    assert StoreProfile.parse(f"down_bandwidth={text}").down_bandwidth_bytes_per_s == bytes_per_s


@pytest.mark.parametrize(("text", "seconds"), [("100ms", 0.1), ("0.25s", 0.25), ("500us", 5e-4),
                                               ("0ms", 0.0)])
def test_durations_read_with_their_units(text: str, seconds: float) -> None:
    assert StoreProfile.parse(f"loopback,first_byte={text}").first_byte_s == seconds


@pytest.mark.parametrize("text", [*PRESETS, "s3-node,max_in_flight=7,first_byte=33.3ms",
                                  "loopback,up_bandwidth=123456789B/s,down_bandwidth=3GiB/s"])
def test_the_text_form_reads_back_to_the_same_profile(text: str) -> None:
    profile = StoreProfile.parse(text)
    assert StoreProfile.parse(str(profile)) == profile


@pytest.mark.parametrize(("text", "message"), [
    ("s4-node", r"^store profile 's4-node': expected a preset of \['gcs-node', 'loopback', "
                r"'s3-express-node', 's3-node'\] or key=value overrides, found 's4-node'$"),
    ("s3-node,speed=1GB/s", r"^store profile 's3-node,speed=1GB/s': expected key=value with a "
                            r"key of \[.*\], found 'speed=1GB/s'$"),
    ("s3-node,loopback", r"expected key=value .*, found 'loopback'$"),
    ("first_byte=1ms,first_byte=2ms", r"key 'first_byte' given twice$"),
    ("bandwidth=fast", r"^store profile bandwidth: expected a rate > 0 such as 400MB/s, "
                       r"1.25GB/s, 10Gb/s or 'unlimited', found 'fast'$"),
    ("up_bandwidth=0MB/s", r"^store profile up_bandwidth: expected a rate > 0 .*, found "
                           r"'0MB/s'$"),
    ("connection_bandwidth=400mb/s", r"connection_bandwidth: .*found '400mb/s'$"),
    ("first_byte=soon", r"^store profile first_byte: expected a duration such as 100ms, "
                        r"0.1s or 500us, found 'soon'$"),
    ("first_byte=100", r"first_byte: .*found '100'$"),
    ("max_in_flight=0", r"^store profile max_in_flight: expected an int >= 1 or 'none', found "
                        r"'0'$"),
    ("max_in_flight=-3", r"max_in_flight: .*found '-3'$"),
])
def test_errors_name_the_text_the_field_and_the_value(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StoreProfile.parse(text)


@pytest.mark.parametrize(("fields", "message"), [
    ({"up_bandwidth_bytes_per_s": 0}, r"^StoreProfile.up_bandwidth_bytes_per_s: expected "
                                      r"bytes per second > 0 or None, found 0$"),
    ({"connection_bandwidth_bytes_per_s": float("inf")},
     r"connection_bandwidth_bytes_per_s: .*found inf$"),
    ({"down_bandwidth_bytes_per_s": True}, r"down_bandwidth_bytes_per_s: .*found True$"),
    ({"first_byte_s": -0.1}, r"^StoreProfile.first_byte_s: expected seconds >= 0, found -0.1$"),
    ({"first_byte_s": float("nan")}, r"first_byte_s: .*found nan$"),
    ({"max_requests_in_flight": 0}, r"^StoreProfile.max_requests_in_flight: expected an int "
                                    r">= 1 or None, found 0$"),
    ({"max_requests_in_flight": 2.0}, r"max_requests_in_flight: .*found 2.0$"),
])
def test_construction_validates_every_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StoreProfile(**fields)  # type: ignore[arg-type]
