"""Running the analysis queries in sql/*.sql with DuckDB over Parquet tables.

A query names its inputs as plain table names (``rounds``, ``tokens`` ...); ``run_query``
binds each to a view over the Parquet files given for it, so the SQL stays plain SQL.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pandas as pd

SQL_DIR = Path(__file__).resolve().parents[2] / "sql"


def query_text(name: str) -> str:
    path = SQL_DIR / f"{name}.sql"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SQL_DIR.glob("*.sql")))
        raise FileNotFoundError(f"no query sql/{name}.sql (available: {known})")
    return path.read_text()


def run_query(name: str, **tables: str | Path | pd.DataFrame) -> pd.DataFrame:
    """Run ``sql/<name>.sql`` with each keyword bound to a view over a Parquet file or glob,
    or to an in-memory DataFrame (the result of an earlier query)."""
    con = duckdb.connect()
    try:
        for table, source in tables.items():
            if isinstance(source, pd.DataFrame):
                con.register(table, source)
                continue
            src = str(source).replace("'", "''")
            con.execute(f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{src}')")
        return con.execute(query_text(name)).fetchdf()
    finally:
        con.close()
