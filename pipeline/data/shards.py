"""Sharded, resumable Parquet output.

Layout: ``<out>/<table>/shard-00012.parquet`` for each table, and ``<out>/manifest.json`` with
the parameters that determine the rows. A shard is complete when every table's file exists;
each file is written under a temporary name and renamed, so a killed run never leaves a
half-written file under a final name, and a rerun redoes exactly the incomplete shards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


class ManifestMismatchError(ValueError):
    pass


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.parquet"


def write_table_atomic(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def write_shard(out: Path, shard: int, tables: dict[str, pa.Table]) -> None:
    # Written in order; the shard only counts as complete once the last one lands.
    for name, table in tables.items():
        write_table_atomic(table, out / name / shard_name(shard))


def completed_shards(out: Path, tables: tuple[str, ...]) -> set[int]:
    done: set[int] | None = None
    for name in tables:
        present = {
            int(p.stem.split("-")[1])
            for p in (out / name).glob("shard-*.parquet")
            if p.stem.split("-")[1].isdigit()
        }
        done = present if done is None else done & present
    return done or set()


def check_manifest(out: Path, params: dict[str, Any], overwrite: bool = False) -> None:
    """Record the run's parameters; refuse to mix rows from runs with other parameters."""
    manifest = out / "manifest.json"
    if manifest.exists() and not overwrite:
        existing = json.loads(manifest.read_text())
        diff = {k: (existing.get(k), v) for k, v in params.items() if existing.get(k) != v}
        if diff:
            details = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in diff.items())
            raise ManifestMismatchError(
                f"{out} holds a run with other parameters ({details}); choose another output "
                "directory or pass --overwrite to start it afresh"
            )
        return
    if overwrite and out.exists():
        for sub in out.iterdir():
            if sub.is_dir():
                for f in sub.glob("*.parquet"):
                    f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")


def read_table(out: Path, name: str) -> pa.Table:
    """All shards of one table, in shard order."""
    files = sorted((out / name).glob("shard-*.parquet"))
    if not files:
        raise FileNotFoundError(f"no {name} shards under {out}")
    return pa.concat_tables([pq.read_table(f) for f in files])
