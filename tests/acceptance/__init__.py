"""Acceptance checks that run the CLI end to end (`pytest -m acceptance tests/acceptance`; each also runs alone as
`python tests/acceptance/NAME.py`, with the options its docstring lists)."""
