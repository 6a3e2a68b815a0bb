"""``python -m pipeline.report``: the report stage."""

from pipeline.report.stage import main

main()
