"""The Lua scripts Redis runs: package data, installed as gate.lua (pyproject.toml
package-dir) and found with importlib.resources (gate/store/scripts.py LUA_DIR)."""
