"""``python -m relay.sim [flags]``: the `relay sim` command line (cli.py)."""

from relay.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
