"""``python -m mxmoe ...`` runs the ``mxmoe`` command line (see mxmoe.cli)."""

from mxmoe.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
