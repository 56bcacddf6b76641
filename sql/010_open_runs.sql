-- 010: long-lived delivery runs. A delivery run may stay open after its batches are delivered
-- (delivery.linger_secs): while it is open, the stream's sensor assigns every batch it records to
-- that run instead of requesting a new one, so a fresh event does not wait for a run process and a
-- Spark session to start. streams.open_run_key is the run key of the open run (null: none).
-- The sensor sets it when it launches a run and assigns batches to it under a lock on the stream
-- row; the run clears it under the same lock once nothing assigned to it is left, so a batch is
-- never assigned to a run that has stopped looking. A failed run's key is cleared by the sensor.
alter table pgstream.streams add column if not exists open_run_key text;
