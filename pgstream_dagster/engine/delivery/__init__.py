"""The delivery engine, Dagster-free: :mod:`.run` (a delivery run: its rounds, the open run's linger
loop, what it reports), :mod:`.group` (a reader group's delivery run: one process
hosting its members' delivery runs, a thread each), :mod:`.sources` (where events come from, and the one
choice of the source), :mod:`.reads` (the queries every reader runs and the byte budget)."""
