"""Sizes and durations as people type them in magics, kernelspecs and config."""

from __future__ import annotations

import math

import pytest

from jupyter_gpusched.core import GiB, SchedulingError, format_bytes, format_duration, parse_duration, parse_memory

MiB = 1024**2


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("16GiB", 16 * GiB),
        ("16 GiB", 16 * GiB),
        ("16gib", 16 * GiB),
        ("512 MiB", 512 * MiB),
        ("512MiB", 512 * MiB),
        ("1.5GiB", int(1.5 * GiB)),
        ("16 GB", 16 * 1000**3),
        ("16G", 16 * 1000**3),
        ("  2 TiB ", 2 * 1024**4),
        ("4096 B", 4096),
        ("100B", 100),
        (4096, 4096),
        (2.0, 2),
    ],
)
def test_parse_memory_accepts_sizes_as_people_write_them(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("empty", [None, ""])
def test_no_memory_means_a_whole_gpu(empty):
    assert parse_memory(empty) is None


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("lots", "must be a size such as '16GiB'"),
        ("GiB", "must be a size"),
        ("16 G iB", "must be a size"),
        ("-1GiB", "must be a size"),
        ("16 GiBs", "unknown unit 'GiBs'"),
        ("2 PiB", "unknown unit 'PiB'"),
        ("0", "more than 0 bytes"),
        ("0GiB", "more than 0 bytes"),
        (0, "more than 0 bytes"),
        (-5, "more than 0 bytes"),
        (float("nan"), "more than 0 bytes"),
        ("0.5B", "at least 1 byte"),
        ("2048TiB", "more than any GPU has"),
        (float("inf"), "more than any GPU has"),
        pytest.param("9" * 400 + "B", "more than any GPU has", id="400-digit-string"),
        pytest.param(10**400, "too large", id="400-digit-int"),
        (True, "must be a size"),
        ([16], "must be a size"),
    ],
)
def test_parse_memory_rejects_nonsense_naming_the_field(value, says):
    with pytest.raises(SchedulingError) as info:
        parse_memory(value, field="kernelspec memory")
    message = str(info.value)
    assert message.startswith("kernelspec memory")
    assert says in message


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30m", 1800),
        ("1h30m", 5400),
        ("1h 30m", 5400),
        ("1 h 30 m", 5400),
        ("90s", 90),
        (" 90 s ", 90),
        ("0", 0),
        ("2h", 7200),
        ("1.5h", 5400),
        ("2hr", 7200),
        ("10min", 600),
        ("1d", 86400),
        ("1d2h", 93600),
        (90, 90),
        (2.5, 2.5),
    ],
)
def test_parse_duration_accepts_durations_as_people_write_them(text, seconds):
    assert parse_duration(text) == seconds


def test_zero_duration_is_allowed_because_it_has_a_meaning():
    # `%gpu keep 0` unpins; `release_timeout = 0` means "forever".
    assert parse_duration("0") == 0
    assert parse_duration(0) == 0
    assert parse_duration("0m") == 0


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("soon", "must be a duration such as '30m'"),
        ("m", "must be a duration"),
        ("-5m", "must be a duration"),
        ("30m later", "must be a duration"),
        ("1h30", "must be a duration"),
        ("5 5", "must be a duration"),
        ("1.5.3m", "must be a duration"),
        ("30x", "unknown unit 'x'"),
        ("10ms", "unknown unit 'ms'"),
        ("", "must be a duration"),
        ("   ", "must be a duration"),
        (None, "must be a duration"),
        (True, "must be a duration"),
        (-1, "0 or more seconds"),
        (float("nan"), "0 or more seconds"),
        (float("inf"), "too long"),
        pytest.param("9" * 400 + "s", "too long", id="400-digit-string"),
        pytest.param(10**400, "too large", id="400-digit-int"),
    ],
)
def test_parse_duration_rejects_nonsense_naming_the_field(value, says):
    with pytest.raises(SchedulingError) as info:
        parse_duration(value, field="keep")
    message = str(info.value)
    assert message.startswith("keep")
    assert says in message


def test_parse_errors_are_value_errors_for_callers_that_do_not_know_the_core():
    with pytest.raises(ValueError):
        parse_memory("lots")
    with pytest.raises(ValueError):
        parse_duration("soon")


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (None, "-"),
        (0, "0 B"),
        (512, "512 B"),
        (16 * GiB, "16.0 GiB"),
        (512 * MiB, "512.0 MiB"),
        (3 * 1024**4, "3.0 TiB"),
    ],
)
def test_format_bytes(size, text):
    assert format_bytes(size) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "-"), (0, "0s"), (42, "42s"), (90, "1m30s"), (3725, "1h02m"), (-3, "0s"), (59.6, "1m00s")],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("size", [512 * MiB, 16 * GiB, 80 * GiB, 10 * GiB])
def test_formatted_sizes_parse_back_to_the_same_size(size):
    assert parse_memory(format_bytes(size).replace(" ", "")) == size


@pytest.mark.parametrize("seconds", [42, 90, 3725 - 5, 7200])
def test_formatted_durations_parse_back(seconds):
    assert math.isclose(parse_duration(format_duration(seconds)), seconds)


@pytest.mark.parametrize(
    ("gpu_seconds", "words"),
    [(0.0, "no GPU time"), (20.0, "no GPU time"), (60.0, "1 GPU-minute"), (150.0, "2 GPU-minutes"),
     (359.0, "6 GPU-minutes"), (360.0, "0.1 GPU-hours"), (41.2 * 3600, "41.2 GPU-hours")],
)
def test_recent_gpu_time_reads_in_minutes_where_hours_would_read_zero(gpu_seconds, words):
    from jupyter_gpusched.core.units import format_gpu_time

    assert format_gpu_time(gpu_seconds) == words
