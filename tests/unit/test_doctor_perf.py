"""doctor's measurement helpers: size parsing, the nccl-tests formulas, the timing loop."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from elastic_trainer.doctor.perf import (
    BandwidthRow,
    algbw_gbps,
    busbw_factor,
    compute_comm_ratio,
    parse_size,
    parse_sizes,
    time_loop,
)

pytestmark = pytest.mark.timeout(30)

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4", 4),
        ("4096", 4096),
        ("1K", KIB),
        ("1k", KIB),
        ("64KB", 64 * KIB),
        ("64KiB", 64 * KIB),
        ("16M", 16 * MIB),
        (" 2 MiB ", 2 * MIB),
        ("1G", GIB),
        ("8B", 8),
    ],
)
def test_parse_size_binary_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "K", "1.5K", "-1K", "1T", "1KK", "one"])
def test_parse_size_rejects_non_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


def test_default_range_doubles_from_1k_to_64m() -> None:
    sizes = parse_sizes("1K..64M")
    assert sizes[0] == KIB and sizes[-1] == 64 * MIB
    assert len(sizes) == 17
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:], strict=False))


def test_range_with_factor_four() -> None:
    assert parse_sizes("1K..64M:4") == [KIB * 4**i for i in range(9)]


def test_range_stops_at_or_below_the_upper_bound() -> None:
    assert parse_sizes("1K..5K") == [KIB, 2 * KIB, 4 * KIB]


def test_list_is_sorted_and_deduplicated() -> None:
    assert parse_sizes("64K,1K,64K") == [KIB, 64 * KIB]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no sizes"),
        ("6", "multiple of 4"),
        ("0", "multiple of 4"),
        ("2G", "1 GiB"),
        ("64M..1K", "larger than the last"),
        ("1K..64M:1", "factor"),
        ("1K..64M:x", "factor"),
        ("4..1G:1", "factor"),
        (",".join(str(4 * i) for i in range(1, 70)), "more than 64"),
        ("1K..", "is not a size"),
    ],
)
def test_parse_sizes_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_sizes(text)


def test_algbw_is_bytes_over_time_in_gb_per_s() -> None:
    assert algbw_gbps(1_000_000_000, 1.0) == pytest.approx(1.0)
    assert algbw_gbps(64 * MIB, 0.01) == pytest.approx(64 * MIB / 0.01 / 1e9)
    with pytest.raises(ValueError):
        algbw_gbps(1024, 0.0)


@pytest.mark.parametrize(("n", "factor"), [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75), (16, 1.875)])
def test_busbw_factor_is_two_n_minus_one_over_n(n: int, factor: float) -> None:
    assert busbw_factor(n) == pytest.approx(factor)


def test_busbw_is_algbw_times_the_factor() -> None:
    assert BandwidthRow.from_time(2_000_000_000, 1.0, 8).busbw_gbps == pytest.approx(2.0 * 1.75)
    with pytest.raises(ValueError):
        busbw_factor(0)


def test_bandwidth_row_from_time() -> None:
    row = BandwidthRow.from_time(4 * MIB, 0.002, 4)
    assert row.count == MIB  # float32 elements
    assert row.time_us == pytest.approx(2000.0)
    assert row.algbw_gbps == pytest.approx(4 * MIB / 0.002 / 1e9)
    assert row.busbw_gbps == pytest.approx(row.algbw_gbps * 1.5)
    assert set(asdict(row)) == {"size_bytes", "count", "time_us", "algbw_gbps", "busbw_gbps"}


def test_compute_comm_ratio() -> None:
    assert compute_comm_ratio(0.010, 0.001) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        compute_comm_ratio(0.0, 1.0)


def test_time_loop_runs_warmup_then_iters_and_returns_a_mean() -> None:
    calls: list[int] = []
    seconds = time_loop(lambda: calls.append(1), iters=7, warmup=3, device=torch.device("cpu"))
    assert len(calls) == 10
    assert 0 < seconds < 1.0
