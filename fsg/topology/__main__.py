"""``python -m fsg.topology plan ...``: see ``fsg/_src/topology/cli.py``."""

from fsg._src.topology.cli import main

raise SystemExit(main())
