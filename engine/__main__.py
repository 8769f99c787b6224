"""`python -m engine <command>`: see engine/cli.py."""

import sys

from .cli import main

sys.exit(main())
