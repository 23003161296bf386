"""The Typer command-line interface: thin layers that parse options, build a config and call the core."""
