"""Prompts, reference sequences, the tables' schemas, sharded Parquet and DuckDB queries."""
