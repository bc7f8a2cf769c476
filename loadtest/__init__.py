"""Load tests, the DB-only peer baseline and the benchmark runner."""
