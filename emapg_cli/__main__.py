"""`python -m emapg_cli` runs the CLI (also what `accelerate launch -m emapg_cli` needs)."""

from emapg_cli.cli.app import main

if __name__ == "__main__":
    main()
