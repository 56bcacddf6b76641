"""Helpers the tests share (not tests themselves): the pipeline harness (config files, events, a
driver that ticks the sensor and runs deliveries in process), a `dagster dev` launcher, a Dagster
instance on Postgres, an HTTP endpoint that records and fails on demand, and sink test helpers."""
