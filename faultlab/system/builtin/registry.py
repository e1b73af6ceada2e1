"""Every built-in system in one table: the two references and every mutant of the zoo.

A mutant says what a trace needs to show its defect, as class attributes read here
(defaults in brackets): ``concurrency`` [1], the lanes (workers alive at once);
``fault`` [None], a fault the trace must draw (``power``: ``--power-loss``;
``server_crash``: a crash of faultlab's own PostgreSQL server); ``private_server``
[False], a PostgreSQL mutant that needs that server (its clock moved by the trace);
``twin`` [None], the SQLite mutant with the same defect, for a PostgreSQL mutant that
``faultlab mutants`` leaves to the PostgreSQL tests (the SQLite one is judged). Every list of names
faultlab shows or judges is a filter over :data:`BUILTINS`, so adding a mutant is
its class and one line here.

Importing this module imports the zoo (and the trace module its minimal traces are
written in); the loader imports it only for a name other than ``reference``, so a
fork server that runs the reference stays small.
"""

from __future__ import annotations

from faultlab.system.builtin import mutants as seq
from faultlab.system.builtin import race_mutants as race
from faultlab.system.builtin import reference_pg as pg
from faultlab.system.builtin.reference import ReferenceOutbox
from faultlab.system.contract import System

#: In the order ``mutants`` and ``systems`` show them: the SQLite reference and its
#: sequential mutants, the concurrency mutants, the power-loss mutants, then PostgreSQL.
BUILTINS: tuple[type[System], ...] = (
    ReferenceOutbox,
    # sequential: one worker at a time
    seq.NoDedup, seq.SplitAccept, seq.SplitAcceptOutboxFirst, seq.SplitComplete,
    seq.SplitCompleteOutboxFirst, seq.SplitReceipt, seq.FreshKeyOnRecovery,
    seq.NoPayloadCheck, seq.CallerOverwrite, seq.CompleteBeforeSend, seq.ErrorCompletes,
    seq.IdleResend, seq.NonCanonicalRetry, seq.SharedKey, seq.RetryReopens,
    # sequential, caught by drawn data or depth (explore only)
    seq.NewestFirst, seq.CaseInsensitiveKey, seq.TruncatedKey, seq.LossyNumbers,
    seq.UnicodeNormalising, seq.Utf8mb3Column, seq.Float32Amounts, seq.BoundedReceipts,
    # two lanes
    race.NoFencing, race.EagerRescue, race.FinishAndFail, race.StaleRescue, race.SkipLocked,
    race.RacyDedup, race.LeaseTimeFence, race.RelayCursor,
    # power cuts
    seq.WalNormalReceiver, seq.SyncOffCaller, seq.FullSyncCaller,
    # PostgreSQL
    pg.ReferencePg, pg.NoDedupPg, pg.SplitCompletePg, pg.NoSkipLockedClaimPg, pg.NoFencingPg,
    pg.AsyncCommitPg, pg.AdvisoryLockPg, pg.ServerClockLeasePg,
)

BY_NAME: dict[str, type[System]] = {cls.name: cls for cls in BUILTINS}
if len(BY_NAME) != len(BUILTINS):  # a name is how a trace file chooses its system
    raise ImportError("faultlab.system.builtin.registry: two built-in systems share a name")


def concurrency(cls: type[System]) -> int:
    """The lanes a trace needs to show the system's defect (1: sequential traces)."""
    return int(getattr(cls, "concurrency", 1))


def fault(cls: type[System]) -> str | None:
    """The fault a trace must draw to show the defect (``power``, ``server_crash``)."""
    value = getattr(cls, "fault", None)
    return None if value is None else str(value)


def on_postgres(cls: type[System]) -> bool:
    return getattr(cls, "store_kind", None) == "postgres"


def is_reference(cls: type[System]) -> bool:
    """A reference: no defect on purpose (nothing to catch)."""
    return cls in (ReferenceOutbox, pg.ReferencePg)


def needs(cls: type[System]) -> str:
    """What a run needs to show the defect, as command-line flags (for ``systems``)."""
    flags = []
    if on_postgres(cls):
        flags.append("--postgres private" if getattr(cls, "private_server", False)
                     or fault(cls) == "server_crash" else "--postgres")
    if concurrency(cls) > 1:
        flags.append(f"--concurrency {concurrency(cls)}")
    if fault(cls) == "power":
        flags.append("--power-loss")
    return " ".join(flags) or "-"


def judged(cls: type[System]) -> bool:
    """Whether ``faultlab mutants`` judges it: a mutant, not a reference or a twin."""
    return not is_reference(cls) and getattr(cls, "twin", None) is None


def names(*, lanes: int | None = None, fault_drawn: str | None = None,
          postgres: bool | None = None, only_judged: bool = False) -> list[str]:
    """The built-in names that match, in :data:`BUILTINS` order: ``lanes``, the mutants
    that need exactly that many lanes (1: sequential); ``fault_drawn``, the ones that need
    that fault (``""``: none); ``postgres``, on PostgreSQL or not; ``only_judged``, the
    mutants ``faultlab mutants`` judges. None: either."""
    return [cls.name for cls in BUILTINS
            if (lanes is None or (not is_reference(cls) and concurrency(cls) == lanes))
            and (fault_drawn is None or (fault(cls) or "") == fault_drawn)
            and (postgres is None or on_postgres(cls) == postgres)
            and (not only_judged or judged(cls))]
