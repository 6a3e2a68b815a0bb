"""``python -m pipeline.provenance check|mark|refresh``."""

import sys

from pipeline.provenance.record import main

sys.exit(main())
