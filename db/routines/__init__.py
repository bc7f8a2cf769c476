"""The stored routines, one per file: package data, installed as gate.db.routines."""
