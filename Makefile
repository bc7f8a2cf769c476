# Conveniences; README's two commands are scripts/run and scripts/test, which need
# nothing but bash on a fresh Debian machine.
.PHONY: run test lint bench
run:
	scripts/run
test:
	scripts/test
bench:
	loadtest/bench
lint:
	.venv/bin/ruff check gate tests loadtest && .venv/bin/mypy
