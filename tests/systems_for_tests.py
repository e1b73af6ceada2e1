"""Systems that exist only for the tests: named as ``systems_for_tests:ClassName``.

Each is the reference outbox with one change, so a test can show that a check
fails (or a deadline fires) for a reason the test controls.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from faultlab.nemesis.crash import kill_self
from faultlab.process.records import ProcessRecord
from faultlab.system.builtin.reference import CLAIM_SQL, ReferenceOutbox
from faultlab.system.contract import WorkerContext


class HangingOutbox(ReferenceOutbox):
    """accept never returns: the worker must be killed at its deadline."""

    name = "hanging"

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        time.sleep(3600)
        raise AssertionError("unreachable: the deadline kills this worker")


class HangingFamilyOutbox(ReferenceOutbox):
    """accept forks a grandchild, says both PIDs, then both hang.

    The deadline must kill the worker's whole process group, grandchild included.
    """

    name = "hanging-family"

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        child = os.fork()
        if child == 0:
            while True:
                time.sleep(3600)
        context.acknowledge({"worker": os.getpid(), "grandchild": child})
        time.sleep(3600)
        raise AssertionError("unreachable: the deadline kills this worker")


class ForgetfulOutbox(ReferenceOutbox):
    """The receiver never consults its receipts: every delivery makes a new ticket."""

    name = "forgetful"

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        connection = context.connect("downstream.sqlite")
        try:
            connection.execute("BEGIN IMMEDIATE")
            ticket_id = connection.execute(
                "INSERT INTO tickets (operation_id, payload) VALUES (?, ?)",
                (operation_id, payload),
            ).lastrowid
            connection.execute("COMMIT")
        finally:
            connection.close()
        return {"operation_id": operation_id, "result": {"ticket_id": ticket_id}, "replayed": False}


class OnceForgetfulOutbox(ReferenceOutbox):
    """The receiver forgets its receipts once: while the file named by
    ``FAULTLAB_TEST_ONCE_FLAG`` exists, a repeated delivery makes a new ticket and removes
    the file. The failure it causes does not happen again when the trace is replayed."""

    name = "once-forgetful"

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        flag = os.environ.get("FAULTLAB_TEST_ONCE_FLAG")
        if flag and os.path.exists(flag):
            connection = context.connect("downstream.sqlite")
            try:
                seen = connection.execute(
                    "SELECT COUNT(*) FROM tickets WHERE operation_id = ?", (operation_id,)
                ).fetchone()[0]
            finally:
                connection.close()
            if seen:
                os.unlink(flag)
                return ForgetfulOutbox.service(self, context, operation_id, payload)
        return super().service(context, operation_id, payload)


class ChattyOutbox(ReferenceOutbox):
    """accept and service print one line to sys.stdout and one to sys.stderr (no flush:
    the process's exit flushes them), then do as the reference does; dispatch adds what
    its service child printed to its response."""

    name = "chatty"

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        _chat("accept", operation_id)
        return super().accept(context, operation_id, payload)

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        _chat("service", operation_id)
        return super().service(context, operation_id, payload)

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        outputs: list[list[str]] = []
        call = context.call_service

        def call_and_keep(operation_id: str, payload: str) -> ProcessRecord:
            record = call(operation_id, payload)
            outputs.append([record.stdout, record.stderr, str(record.pid)])
            return record

        context.call_service = call_and_keep  # type: ignore[method-assign]
        return {**super().dispatch(context), "service_outputs": outputs}


class ServiceWitnessOutbox(ChattyOutbox):
    """As :class:`ChattyOutbox`, but the service prints which process forked it, where it
    records for power cuts (None when it does not) and how its interpreter was started
    (``-m`` when it was exec'd as a worker, ``-c`` when forked from a fork server or the
    lanes' helper), then serves as the reference does."""

    name = "service-witness"

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        vfs = sys.modules.get("faultlab.stores.vfs")
        recording = vfs.installed_directory() if vfs is not None else None
        print(f"service parent {os.getppid()} recording {recording}")
        print(f"service interpreter {sys.orig_argv[1]}")
        return ReferenceOutbox.service(self, context, operation_id, payload)


def _chat(role: str, operation_id: str) -> None:
    print(f"chatty {role} stdout {operation_id} pid {os.getpid()}")
    print(f"chatty {role} stderr {operation_id} pid {os.getpid()}", file=sys.stderr)


class EscapingOutbox(ReferenceOutbox):
    """accept starts a grandchild that leaves the worker's process group (setsid) while
    still holding the worker's stdout and stderr, says its PID, then hangs.

    The deadline cannot kill the escapee (it is no longer in the group), but it must
    still bound how long faultlab waits for the worker's output.
    """

    name = "escaping"

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        child = os.fork()
        if child == 0:
            os.setsid()
            while True:
                time.sleep(3600)
        context.acknowledge({"worker": os.getpid(), "escaped": child})
        time.sleep(3600)
        raise AssertionError("unreachable: the deadline kills this worker")


class HangsWhenExploredOutbox(ReferenceOutbox):
    """The five scenarios pass (their payload names a project); any other accept hangs, so the
    exploration phase of ``suite`` stops with a deadline error after the scenarios ran."""

    name = "hangs-when-explored"

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        if '"project"' not in payload:
            time.sleep(3600)
        return super().accept(context, operation_id, payload)


class DeclaredDataOutbox(ReferenceOutbox):
    """The reference, declaring its own payloads and operation ids (faultlab.search.data)."""

    name = "declared-data"

    def payloads(self) -> Any:
        from hypothesis import strategies as st

        return st.fixed_dictionaries({"sku": st.sampled_from(["A", "B"])},
                                     optional={"quantity": st.integers(1, 9)})

    def operation_ids(self) -> Any:
        from hypothesis import strategies as st

        return st.integers(1, 99999).map(lambda n: f"ORD-{n:05d}")


def _lingering_pg() -> type[Any]:
    from faultlab.system.builtin.reference_pg import ReferencePg

    class LingeringPg(ReferencePg):
        """accept locks its row, hands its connection to a child that outlives it, dies.

        The child keeps the socket open, so the server cannot end the backend: it lingers
        holding the row lock, which faultlab must report instead of waiting forever. The
        child exits by itself after LINGER seconds.
        """

        name = "lingering-pg"

        def accept(
            self, context: WorkerContext, operation_id: str, payload: str
        ) -> dict[str, Any]:
            connection = context.connect_postgres("caller")
            connection.execute(
                "INSERT INTO operations (id, payload, state) VALUES (%s, %s, 'pending')",
                (operation_id, payload),
            )
            if os.fork() == 0:  # keeps the socket, not the worker's output pipes
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
                time.sleep(float(os.environ.get("FAULTLAB_TEST_LINGER", "8")))
                os._exit(0)
            kill_self()
            raise AssertionError("unreachable")

    return LingeringPg


def __getattr__(name: str) -> Any:
    """PostgreSQL test systems are built on first use, so psycopg stays optional here."""
    if name == "LingeringPg":
        return _lingering_pg()
    raise AttributeError(name)

class WallClockRetryOutbox(ReferenceOutbox):
    """A relay as a third-party outbox library writes it: it reads ``time.time()``, never
    faultlab's clock, and a claim hides the entry for ``BACKOFF`` seconds (the retry
    delay), so the entry of a dispatcher that died is retried 5 s later. It announces no
    claims (a library would not). ``virtual_wall_clock`` runs it under libfaketime."""

    name = "wall-clock-retry"
    virtual_wall_clock = True
    BACKOFF = 5.0

    def next_pending(self, connection: sqlite3.Connection) -> tuple[str, str] | None:
        now = time.time()
        rows = connection.execute(CLAIM_SQL, (now + self.BACKOFF, now)).fetchall()
        self.claim = None  # unannounced and unfenced, as the library does it
        return None if not rows else (rows[0][0], rows[0][2])

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        return {**super().dispatch(context), "wall_time": time.time()}


class WallClockDroppedOutbox(WallClockRetryOutbox):
    """The same library, but a claimed entry's retry lies beyond any horizon: work whose
    dispatcher dies is dropped for good, and LIVE must still say so."""

    name = "wall-clock-dropped"
    BACKOFF = 10.0 ** 7


class RealClockRetryOutbox(WallClockRetryOutbox):
    """The same library on the real wall clock: the retry is still ahead when the final
    recovery runs (the control: without the virtual wall clock, LIVE is reported). Its
    back-off is 60 s rather than 5 s only so that a slow, shared machine cannot reach it."""

    name = "real-clock-retry"
    virtual_wall_clock = False
    BACKOFF = 60.0


class SlowStartOutbox(ReferenceOutbox):
    """A dispatcher that computes for ``FAULTLAB_TEST_SPIN`` seconds (default 1.6) before
    its first point, as an exec'd interpreter starting on a loaded machine does: longer
    than the lane executor's block bound, but working, not waiting on a lock."""

    name = "slow-start"

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        end = time.monotonic() + float(os.environ.get("FAULTLAB_TEST_SPIN", "1.6"))
        while time.monotonic() < end:
            pass
        return super().dispatch(context)


class DividingOutbox(ReferenceOutbox):
    """Every dispatcher dies with an unexpected Python exception (a traceback on stderr,
    exit 70): each later check fails for that one reason, which a report must show once."""

    name = "dividing"

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        return {"ratio": len(context.directory.name) // 0}


class RefusingOutbox(ReferenceOutbox):
    """accept refuses every payload as bad input: a JSON error on stdout, exit 2, nothing
    on stderr."""

    name = "refusing"

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        from faultlab.system.contract import Refusal

        raise Refusal("unsupported_payload", 2, operation_id=operation_id)


class NullServicePidOutbox(ReferenceOutbox):
    """The dispatcher reports its service child with a null PID, as a command-line program
    whose response_fields point at an empty field does."""

    name = "null-service-pid"

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        response = super().dispatch(context)
        if isinstance(response.get("service"), dict):
            response["service"] = {**response["service"], "pid": None}
        return response


class OnceRefusingOutbox(ReferenceOutbox):
    """A dispatcher refuses its input once (exit 2, a run failure): while the file named by
    ``FAULTLAB_TEST_ONCE_FLAG`` exists, the dispatcher removes it and exits 2. The error
    does not happen again when Hypothesis reruns the example (it calls that flaky)."""

    name = "once-refusing"

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        from faultlab.system.contract import Refusal

        flag = os.environ.get("FAULTLAB_TEST_ONCE_FLAG")
        if flag and os.path.exists(flag):
            os.unlink(flag)
            raise Refusal("refused_once", 2)
        return super().dispatch(context)


class SlowDispatchOutbox(ReferenceOutbox):
    """The reference, but each dispatcher first waits (a network call, a back-off) for
    ``FAULTLAB_TEST_DISPATCH_SLEEP`` seconds (default 2) without using the CPU: slow,
    never wrong."""

    name = "slow-dispatch"

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        time.sleep(float(os.environ.get("FAULTLAB_TEST_DISPATCH_SLEEP", "2")))
        return super().dispatch(context)


class HangingDispatchOutbox(ReferenceOutbox):
    """dispatch never returns: a deadline must end it, as a run failure."""

    name = "hanging-dispatch"

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        time.sleep(3600)
        raise AssertionError("unreachable: the deadline kills this worker")


class UnreleasableOutbox(ReferenceOutbox):
    """Its stores cannot be released when a trace ends (as when the PostgreSQL server that
    held its databases has died): the run directory must go all the same."""

    def release(self, directory: Any) -> None:
        from faultlab.stores.sqlite import StoreError

        raise StoreError(f"cannot release the stores of {directory}: the server is gone")


class FamilyOutbox(ReferenceOutbox):
    """The reference, but its dispatcher reports its own pid and process group, and its
    service its pid, parent and process group, in the dispatcher's response: where each
    process sits in the tree."""

    name = "family"

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        return {**super().service(context, operation_id, payload),
                "family": [os.getpid(), os.getppid(), os.getpgid(0)]}

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        families: list[Any] = []
        call = context.call_service

        def call_and_keep(operation_id: str, payload: str) -> ProcessRecord:
            record = call(operation_id, payload)
            families.append((record.response or {}).get("family"))
            return record

        context.call_service = call_and_keep  # type: ignore[method-assign]
        return {**super().dispatch(context), "dispatcher": [os.getpid(), os.getpgid(0)],
                "families": families}


class HangingServiceOutbox(ReferenceOutbox):
    """The service writes its pid to ``service.pid`` in the stores' directory, then hangs:
    the dispatcher's deadline must kill it with the dispatcher."""

    name = "hanging-service"

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        (context.directory / "service.pid").write_text(str(os.getpid()))
        time.sleep(3600)
        raise AssertionError("unreachable: the deadline kills this service")


class LockLeavingOutbox(ReferenceOutbox):
    """accept takes a POSIX lock on ``held.lock`` in the stores' directory (the kind SQLite
    takes) and leaves its descriptor open, as a connection left open would; with
    ``{"previous": PID}`` as payload it also says whether that process is still in /proc
    (running, exiting or a zombie) as it runs."""

    name = "lock-leaving"

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        import fcntl

        held = os.open(context.directory / "held.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.lockf(held, fcntl.LOCK_EX)
        previous = json.loads(payload).get("previous")
        return {"worker": os.getpid(),
                "previous_in_proc": previous is not None and os.path.exists(f"/proc/{previous}")}


class ThreadLeavingOutbox(LockLeavingOutbox):
    """accept leaves a second thread running (asleep) as it returns: a process that could
    still act after its descriptors were closed, which the fork server must see exit
    before it answers."""

    name = "thread-leaving"

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        import _thread

        _thread.start_new_thread(time.sleep, (3600,))
        return super().accept(context, operation_id, payload)


class StoreWatchingOutbox(ReferenceOutbox):
    """accept watches its stores' directory until it is killed (it never returns), and
    writes ``watching`` in the directory ``FAULTLAB_TEST_WITNESS`` names as it starts.
    Should the stores' directory go while it still runs (the run removed the stores under
    a live worker, which could still write them), it writes ``outlived`` there too."""

    name = "store-watching"

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        witnesses = Path(os.environ["FAULTLAB_TEST_WITNESS"])
        (witnesses / "watching").write_text(f"worker {os.getpid()}\n")
        witness = witnesses / "outlived"
        while context.directory.exists():
            time.sleep(0.001)
        witness.write_text(f"worker {os.getpid()} outlived {context.directory}\n")
        time.sleep(3600)
        raise AssertionError("unreachable: the run kills this worker")
