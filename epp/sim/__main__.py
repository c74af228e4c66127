"""`python -m epp.sim ...`: the `epp sim` subcommand without the top-level CLI."""

import argparse

from epp.sim.cli import add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m epp.sim")
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
