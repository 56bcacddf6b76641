"""The delivery engine, Dagster-free: :mod:`.run` (a delivery run), :mod:`.group` (a reader group's delivery
run: its members' runs, a thread each), :mod:`.sources` (the one choice of a source), :mod:`.reads` (queries)."""
