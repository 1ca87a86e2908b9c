"""``python -m mie``: the command-line interface (see ``mie.cli``)."""

from mie.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
