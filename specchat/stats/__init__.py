"""Per-turn statistics in SQLite (sqlite-utils). Imports no model code."""
