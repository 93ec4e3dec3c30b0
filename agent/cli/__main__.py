"""`python -m agent.cli`: the `ssp-agent` command."""
import sys

from . import main

sys.exit(main())
