"""The ledger (``pgstream.batches``) and everything else pgstream keeps per stream in Postgres, by concern;
callers import its modules by name (``from pgstream_dagster.engine.ledger import state``):

* :mod:`.streams`: stream rows and the slot each reads;
* :mod:`.recording`: recording what was read from a slot (batches, unreadable events, recovery);
* :mod:`.state`: a stream's state in one query, the batch and open-run transitions, the slot's
  declared reader, and :func:`~.state.apply` (a decision of ``batches.decide``);
* :mod:`.locks`: pgstream's locks and the delivery lease;
* :mod:`.deadletters`: what delivery skips and the writer that sets a rejected event aside;
* :mod:`.keyprogress`: the resume points of ``ordering: by_key``;
* :mod:`.groups`: reader groups (streams sharing one slot) and a stream's hand-over to its group.
"""
