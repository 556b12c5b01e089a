"""Benchmark: what validating records costs on the read path, measured side by side.

Parses the fixture records (today's records, as the store reads them on every
``GET /records`` and every ``status``) through ``codec.parse_record`` (UTF-8, JSON, the
schema) and through ``json.loads`` alone, alternating, and prints the medians per
record and their ratio. The checks are stdlib functions; their holder, lease, handle
and attempt tables are built once, at import, from ``core.record_shapes``.

    python bench/record_codec.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from gpuctl.adapters.store.codec import parse_record

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "records"


def per_record_us(fn: object, blobs: list[bytes], reps: int) -> float:
    assert callable(fn)
    t0 = time.perf_counter()
    for _ in range(reps):
        for raw in blobs:
            fn(raw)
    return (time.perf_counter() - t0) / (reps * len(blobs)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    blobs = [p.read_bytes() for p in sorted(FIXTURES.glob("*.json"))]
    schema: list[float] = []
    plain: list[float] = []
    for _ in range(args.rounds):  # alternate, so a noisy neighbour hits both alike
        schema.append(per_record_us(parse_record, blobs, 20))
        plain.append(per_record_us(json.loads, blobs, 20))
    print(f"records: {len(blobs)} fixtures, rounds: {args.rounds} (alternating)")
    # The minimum is the cost itself; the median adds what a busy machine lent others.
    for name, pick in (("min", min), ("median", statistics.median)):
        s, p = pick(schema), pick(plain)
        print(
            f"{name:6}: json.loads {p:6.1f} us, parse_record {s:6.1f} us per record; "
            f"ratio {s / p:.2f}x (+{s - p:.1f} us)"
        )


if __name__ == "__main__":
    main()
