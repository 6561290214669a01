"""`python -m gateway …` is the `gateway` command."""

import sys

from gateway.cli import main

sys.exit(main())
