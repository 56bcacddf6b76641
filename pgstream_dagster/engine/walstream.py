"""A slot over the replication protocol (psycopg2's ``LogicalReplicationConnection``; psycopg 3 has none):
what a group delivery run's reader reads (``ingest.GroupStream``). Apart from
``replication.py`` so that nothing the Spark executors import needs psycopg2."""

from __future__ import annotations

import select
import time

import psycopg2
import psycopg2.errors
import psycopg2.extensions
import psycopg2.extras


class SlotBusy(RuntimeError):
    """The slot is in use by another connection (the sensor's peek, or another reader)."""


class SlotGone(RuntimeError):
    """The slot or its publication does not exist, or the slot was invalidated: the sensor replaces it."""


class StreamBroken(RuntimeError):
    """The replication connection failed (the server went away, the walsender was ended)."""


class ReplicationStream:
    """The slot over the replication protocol: the publication's messages from the confirmed position, each
    transaction as it commits; only :meth:`confirm` moves the slot; ``wal_end``: how far the server has sent."""

    #: messages read per :meth:`read` at most (then the caller records what it has)
    MAX_MESSAGES = 20_000
    #: bytes of messages read per :meth:`read` at most (one message at least)
    MAX_BYTES = 32 * 2**20

    def __init__(self, database_url: str, slot: str, publication: str, application_name: str, *,
                 max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        #: the last :meth:`read` stopped at :attr:`MAX_MESSAGES` or ``max_bytes``: more may be waiting
        self.full = False
        try:
            self._conn = psycopg2.connect(database_url, application_name=application_name,
                                          connection_factory=psycopg2.extras.LogicalReplicationConnection)
        except psycopg2.OperationalError as exc:
            raise ConnectionError(f"cannot open a replication connection: {str(exc).strip()[:300]}") from None
        self._cur: psycopg2.extras.ReplicationCursor = self._conn.cursor()
        self.confirmed = 0
        try:
            self._cur.start_replication(slot_name=slot, decode=False, status_interval=10, options={
                "proto_version": "1", "publication_names": publication})
        except psycopg2.errors.ObjectInUse:
            self.close()
            raise SlotBusy(f"slot {slot} is in use by another connection") from None
        except (psycopg2.errors.UndefinedObject, psycopg2.errors.ObjectNotInPrerequisiteState) as exc:
            self.close()
            raise SlotGone(f"slot {slot}: {str(exc).strip()[:300]}") from None
        except psycopg2.Error as exc:
            self.close()
            raise StreamBroken(f"slot {slot}: {str(exc).strip()[:300]}") from None

    @property
    def wal_end(self) -> int:
        return int(self._cur.wal_end or 0)

    def read(self, timeout: float) -> list[bytes]:
        """The messages available now, waiting up to ``timeout`` for the first: at most :attr:`MAX_MESSAGES`,
        none more once they hold ``max_bytes`` (:attr:`full` then says more may be waiting)."""
        messages: list[bytes] = []
        deadline = time.monotonic() + timeout
        size = 0
        while len(messages) < self.MAX_MESSAGES and size < self.max_bytes:
            if (message := self._read_one()) is not None:
                messages.append(message)
                size += len(message)
                continue
            remaining = deadline - time.monotonic()
            if messages or remaining <= 0:
                break
            try:
                select.select([self._cur], [], [], remaining)
            except (OSError, ValueError) as exc:  # the connection closed under it
                raise StreamBroken(str(exc)) from None
        self.full = len(messages) >= self.MAX_MESSAGES or size >= self.max_bytes
        return messages

    def _read_one(self) -> bytes | None:
        try:
            message = self._cur.read_message()
        except (psycopg2.errors.UndefinedObject, psycopg2.errors.ObjectNotInPrerequisiteState) as exc:
            raise SlotGone(str(exc).strip()[:300]) from None
        except psycopg2.Error as exc:
            raise StreamBroken(str(exc).strip()[:300]) from None
        if message is None:
            return None
        payload = message.payload
        return payload if isinstance(payload, bytes) else bytes(payload, "utf-8")

    def confirm(self, lsn: int, *, reply: bool = False) -> None:
        """Everything before ``lsn`` is recorded: the slot may release it. ``reply``: ask the server
        for a keepalive now (it refreshes :attr:`wal_end`)."""
        self.confirmed = max(self.confirmed, lsn)
        try:
            # types-psycopg2 leaves send_feedback untyped
            self._cur.send_feedback(  # type: ignore[no-untyped-call]
                write_lsn=self.confirmed, flush_lsn=self.confirmed, reply=reply, force=True)
        except psycopg2.Error as exc:
            raise StreamBroken(str(exc).strip()[:300]) from None

    def close(self) -> None:
        try:
            self._conn.close()
        except psycopg2.Error:
            pass
