"""The Dagster definitions: resources, sensors, jobs, assets, checks, schedules. They run the
engine (``pgstream_dagster.engine``) and hold no SQL of their own."""
