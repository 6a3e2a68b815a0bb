"""``python -m pipeline.search --task TASK``: the search stage."""

from pipeline.search.stage import main

main()
