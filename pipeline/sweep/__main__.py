"""``python -m pipeline.sweep --task TASK``: the sweep stage."""

from pipeline.sweep.stage import main

main()
