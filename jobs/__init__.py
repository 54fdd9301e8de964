"""Command-line entry points: each parses arguments, makes one pipeline call, prints and logs."""
