"""The ledger (``pgstream.batches``) and everything else pgstream keeps per stream in Postgres, by concern:

* :mod:`.streams`: stream rows and the slot each reads;
* :mod:`.recording`: recording what was read from a slot (batches, unreadable events, recovery);
* :mod:`.state`: a stream's state in one query, the batch and open-run transitions, the slot's
  declared reader, and :func:`apply` (a decision of ``batches.decide``);
* :mod:`.locks`: pgstream's locks, the delivery lease, the recording lock;
* :mod:`.deadletters`: what delivery skips and the writer that sets a rejected event aside;
* :mod:`.keyprogress`: the resume points of ``ordering: by_key``;
* :mod:`.groups`: reader groups (streams sharing one slot) and a stream's hand-over to its group.

Every name is re-exported here: ``from pgstream_dagster.engine import ledger; ledger.X``.
"""

from .deadletters import (
    DeadLetterWriter as DeadLetterWriter,
)
from .deadletters import (
    dead_letter_positions as dead_letter_positions,
)
from .deadletters import (
    vanished as vanished,
)
from .groups import (
    GROUP_PREFIX as GROUP_PREFIX,
)
from .groups import (
    Group as Group,
)
from .groups import (
    GroupChange as GroupChange,
)
from .groups import (
    Member as Member,
)
from .groups import (
    MemberRun as MemberRun,
)
from .groups import (
    begin_join as begin_join,
)
from .groups import (
    ensure_group_publication as ensure_group_publication,
)
from .groups import (
    finish_join as finish_join,
)
from .groups import (
    group_publication as group_publication,
)
from .groups import (
    group_reader as group_reader,
)
from .groups import (
    group_state as group_state,
)
from .groups import (
    mark_group_consumed as mark_group_consumed,
)
from .groups import (
    mark_members_consumed as mark_members_consumed,
)
from .groups import (
    member_runs as member_runs,
)
from .groups import (
    member_signals as member_signals,
)
from .groups import (
    open_run_keys as open_run_keys,
)
from .groups import (
    record_group_through as record_group_through,
)
from .groups import (
    register_group_member as register_group_member,
)
from .groups import (
    register_missing_members as register_missing_members,
)
from .groups import (
    set_group_recovery_pending as set_group_recovery_pending,
)
from .keyprogress import (
    KeyProgress as KeyProgress,
)
from .keyprogress import (
    Position as Position,
)
from .keyprogress import (
    RunGone as RunGone,
)
from .keyprogress import (
    clear_key_progress as clear_key_progress,
)
from .keyprogress import (
    issue_delivery_token as issue_delivery_token,
)
from .keyprogress import (
    key_progress_partitions as key_progress_partitions,
)
from .locks import (
    DELIVERY_LOCK as DELIVERY_LOCK,
)
from .locks import (
    LEASE_POLL_SECS as LEASE_POLL_SECS,
)
from .locks import (
    LEASE_WAIT_LOCK as LEASE_WAIT_LOCK,
)
from .locks import (
    READER_LOCK as READER_LOCK,
)
from .locks import (
    REDELIVERY_LOCK as REDELIVERY_LOCK,
)
from .locks import (
    REPLAY_LOCK as REPLAY_LOCK,
)
from .locks import (
    LeaseState as LeaseState,
)
from .locks import (
    LeaseTaken as LeaseTaken,
)
from .locks import (
    RecordingCheck as RecordingCheck,
)
from .locks import (
    acquire_group_lease as acquire_group_lease,
)
from .locks import (
    acquire_lease as acquire_lease,
)
from .locks import (
    acquire_replay_lease as acquire_replay_lease,
)
from .locks import (
    claim_group_reading as claim_group_reading,
)
from .locks import (
    claim_slot as claim_slot,
)
from .locks import (
    give_up_group_lease as give_up_group_lease,
)
from .locks import (
    give_up_lease as give_up_lease,
)
from .locks import (
    group_lease_state as group_lease_state,
)
from .locks import (
    group_reading_holder as group_reading_holder,
)
from .locks import (
    holding_lease as holding_lease,
)
from .locks import (
    lease_alive as lease_alive,
)
from .locks import (
    lease_name as lease_name,
)
from .locks import (
    lease_state as lease_state,
)
from .locks import (
    lease_states as lease_states,
)
from .locks import (
    lock_holder as lock_holder,
)
from .locks import (
    lock_recording as lock_recording,
)
from .locks import (
    release_group_reading as release_group_reading,
)
from .locks import (
    release_slot as release_slot,
)
from .locks import (
    replay_waiting as replay_waiting,
)
from .locks import (
    slot_claimed as slot_claimed,
)
from .locks import (
    try_lock as try_lock,
)
from .locks import (
    unlock as unlock,
)
from .recording import (
    NotVisibleYet as NotVisibleYet,
)
from .recording import (
    ReaderIsSynchronousStandby as ReaderIsSynchronousStandby,
)
from .recording import (
    last_end_lsn as last_end_lsn,
)
from .recording import (
    mark_consumed as mark_consumed,
)
from .recording import (
    record as record,
)
from .recording import (
    record_unreadable as record_unreadable,
)
from .recording import (
    recover_from_table as recover_from_table,
)
from .recording import (
    recovered_ids_since as recovered_ids_since,
)
from .recording import (
    recovery_pending as recovery_pending,
)
from .recording import (
    set_recovery_pending as set_recovery_pending,
)
from .recording import (
    wait_until_visible as wait_until_visible,
)
from .state import (
    SENSOR as SENSOR,
)
from .state import (
    Assigned as Assigned,
)
from .state import (
    Batch as Batch,
)
from .state import (
    StreamPaused as StreamPaused,
)
from .state import (
    apply as apply,
)
from .state import (
    apply_run as apply_run,
)
from .state import (
    assign as assign,
)
from .state import (
    assigned_after as assigned_after,
)
from .state import (
    batches_between as batches_between,
)
from .state import (
    clear_open_run as clear_open_run,
)
from .state import (
    earlier_open as earlier_open,
)
from .state import (
    enter_failover as enter_failover,
)
from .state import (
    extend_run as extend_run,
)
from .state import (
    fail_run as fail_run,
)
from .state import (
    give_back as give_back,
)
from .state import (
    is_paused as is_paused,
)
from .state import (
    launch as launch,
)
from .state import (
    launch_waiting as launch_waiting,
)
from .state import (
    leave_failover as leave_failover,
)
from .state import (
    listen_runs as listen_runs,
)
from .state import (
    lock_slot_reader as lock_slot_reader,
)
from .state import (
    mark_confirmed as mark_confirmed,
)
from .state import (
    mark_delivered as mark_delivered,
)
from .state import (
    mark_failed as mark_failed,
)
from .state import (
    next_assigned as next_assigned,
)
from .state import (
    open_run as open_run,
)
from .state import (
    open_warm_run as open_warm_run,
)
from .state import (
    publishing as publishing,
)
from .state import (
    release as release,
)
from .state import (
    retry_now as retry_now,
)
from .state import (
    round_outcome as round_outcome,
)
from .state import (
    run_batch_ids as run_batch_ids,
)
from .state import (
    run_channel as run_channel,
)
from .state import (
    run_is_open as run_is_open,
)
from .state import (
    run_reader as run_reader,
)
from .state import (
    skip_batch as skip_batch,
)
from .state import (
    slot_reader as slot_reader,
)
from .state import (
    stream_state as stream_state,
)
from .state import (
    stream_states as stream_states,
)
from .streams import (
    SLOT_INDEX as SLOT_INDEX,
)
from .streams import (
    SlotElsewhere as SlotElsewhere,
)
from .streams import (
    SlotInUse as SlotInUse,
)
from .streams import (
    check_slots as check_slots,
)
from .streams import (
    ensure_stream as ensure_stream,
)
from .streams import (
    slot_holder as slot_holder,
)
from .streams import (
    stream_slot as stream_slot,
)
