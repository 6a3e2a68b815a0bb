"""``python -m pipeline.evaluate --task TASK``: the evaluate stage."""

from pipeline.evaluate.stage import main

main()
