"""The SQL migrations: package data, installed as gate.db (pyproject.toml package-dir)
and found with importlib.resources (gate/store/migrate.py DB_DIR)."""
