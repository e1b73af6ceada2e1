"""Leases on the server's clock: a private PostgreSQL server's ``now()`` follows a concurrent
trace's ``tick`` steps, ``reference-pg`` stamps and checks its leases with it, and the
mutant of that class, ``server-clock-lease-pg``, is caught.

Against real servers only: skipped with the reason when this machine cannot start a
private server with a virtual clock (no ``postgres`` user or initdb, no psycopg, no
libfaketime), failed instead when FAULTLAB_REQUIRE_SERVICES names ``postgres``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, require_private_postgres, require_service

from faultlab.base import wall_clock
from faultlab.run.executor import Executor, execute
from faultlab.stores import postgres as pgstores
from faultlab.stores.pgserver import PrivateServer
from faultlab.system import concurrency_mutant_names, load_system
from faultlab.system.builtin.reference import LEASE_TICKS
from faultlab.trace import Step

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

PAYLOAD = {"title": "invoice", "count": 3}


def _require() -> None:
    require_private_postgres()
    if wall_clock.library() is None:
        require_service("postgres", "libfaketime is not installed: the private server's "
                                    "clock cannot follow the ticks")


@pytest.fixture(scope="module")
def private() -> Iterator[PrivateServer]:
    """One private server with a virtual clock, the stores configured on it."""
    _require()
    server = PrivateServer(virtual_clock=True)
    try:
        server.start()
        pgstores.configure(server.conninfo, server=server)
        yield server
    finally:
        pgstores.close_run()
        pgstores.configure(None)
        server.stop()


def _server_now(directory: Path) -> float:
    """The server's clock_timestamp() as seen from the trace's caller store, in seconds
    since the virtual clock's epoch."""
    connection = pgstores.connect(directory, "caller", role="snapshot")
    try:
        row = connection.execute("SELECT extract(epoch FROM clock_timestamp())::float8")\
            .fetchone()
        connection.rollback()
    finally:
        connection.close()
    return float(row[0]) - wall_clock.EPOCH


def _lease_ends(directory: Path) -> list[float | None]:
    connection = pgstores.connect(directory, "caller", role="snapshot")
    try:
        rows = connection.execute(
            "SELECT CASE WHEN lease_until = '-infinity' THEN NULL "
            "ELSE extract(epoch FROM lease_until)::float8 - %s END FROM outbox ORDER BY seq",
            (wall_clock.EPOCH,)).fetchall()
        connection.rollback()
    finally:
        connection.close()
    return [None if value is None else float(value) for (value,) in rows]


def test_server_clock_lease_pg_needs_a_server_whose_clock_moves(tmp_path: Path) -> None:
    """On a shared server (or a private one on the real clock) the mutant is refused
    before any store exists: its leases would never lapse at a tick there. Asked of a fresh
    faultlab: this process may hold an earlier test's private server (the test was skipped
    then, depending on which tests an xdist worker had run before it)."""
    pytest.importorskip("psycopg")
    corpus = tmp_path / "corpus"
    done = _faultlab("explore", "--system", "server-clock-lease-pg", "--examples", "1",
                     "--corpus", str(corpus))
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("faultlab: error: ") and "--postgres private" in line
    assert not corpus.exists() and done.stdout == ""


def test_the_private_servers_now_follows_the_ticks(private: PrivateServer) -> None:
    """Each trace starts the server's clock at its epoch; a tick moves it by exactly the
    ticks (one tick, one second), and nothing else moves it."""
    private.set_clock(500)  # what a previous trace may have left
    with Executor(load_system("reference-pg"), concurrency=2) as ex:
        assert pgstores.stores_info(ex.directory).server_clock is True
        start = _server_now(ex.directory)
        assert start == 0.0
        ex.run(Step("accept", "op-1", PAYLOAD, lane=1))
        assert _server_now(ex.directory) == start
        ex.run(Step("tick", ticks=7))
        assert _server_now(ex.directory) - start == 7.0
        ex.run(Step("tick", ticks=LEASE_TICKS))
        assert _server_now(ex.directory) - start == 7.0 + LEASE_TICKS
        assert private.clock == 7 + LEASE_TICKS


def test_reference_pg_stamps_its_lease_with_the_servers_now(private: PrivateServer) -> None:
    """The lease is the claim transaction's now() + 10 s on the server: a dispatcher held
    inside its claim while 4 ticks pass commits a lease that ends at 10, announces it so,
    and a second dispatcher claims exactly when the server's lease lapses."""
    with Executor(load_system("reference-pg"), concurrency=2) as ex:
        ex.run(Step("accept", "op-1", PAYLOAD, lane=1))
        ex.run(Step("dispatch", lane=1, hold=True))  # held inside the claim transaction
        assert _lease_ends(ex.directory) == [None]
        ex.run(Step("tick", ticks=4))
        ex.run(Step("release", lane=1))
        assert _lease_ends(ex.directory) == [float(LEASE_TICKS)]
        assert [(c.lease_until, c.at) for c in ex.history.claims] == [(10.0, 4)]
        ex.run(Step("tick", ticks=LEASE_TICKS - 5))  # 9: the server's lease still runs
        early = ex.run(Step("dispatch", lane=2))
        assert [r.response for _, r in early.exited] == [{"idle": True}]
        ex.run(Step("tick", ticks=1))
        rescued = ex.run(Step("dispatch", lane=2))
        assert [r.response["result"] for _, r in rescued.exited] == [{"ticket_id": 1}]
        last = ex.run(Step("finish", lane=1))
        assert [r.response["superseded"] for _, r in last.exited] == [True]
        assert last.violations == ()


def test_server_clock_lease_pg_is_caught_at_its_minimal_trace_and_reference_pg_is_not(
        private: PrivateServer) -> None:
    """The mutant trusts the lease it counted from its commit, 10 ticks past the one the
    server stamped: lane 2 claims when the server's lease lapses, lane 1 completes too
    (FENCE). The same trace is clean on reference-pg, whose lane 1 is superseded."""
    mutant = load_system("server-clock-lease-pg")
    assert mutant.name in concurrency_mutant_names()
    trace = list(mutant.minimal_trace)
    caught = execute(mutant, trace, laned=True, concurrency=mutant.concurrency, settle=True)
    assert len(caught.executed_prefix()) == mutant.minimal_steps == len(trace) == 5
    assert caught.verdict.invariants == ("FENCE",)
    clean = execute(load_system("reference-pg"), trace, concurrency=2, settle=True)
    assert clean.verdict.clean


def test_a_lane_killed_while_waiting_for_a_lock_loses_its_backend_on_a_frozen_clock(
        private: PrivateServer) -> None:
    """The client connection check is a timeout on the server's wall clock, which a frozen
    virtual clock never lets fire: the backend of a lane killed while it waits for a lock
    is ended by faultlab instead, as the check would end it, and the trace goes on."""
    with Executor(load_system("reference-pg"), concurrency=2) as ex:
        ex.run(Step("accept", "op-1", PAYLOAD, lane=1, hold=True))
        blocked = ex.run(Step("accept", "op-1", PAYLOAD, lane=2))
        assert blocked.lanes == ("accept @during_accept", "accept blocked")
        killed = ex.run(Step("kill", lane=2))
        assert [r.exit_code for _, r in killed.exited] == [-9]
        assert killed.violations == ()
        finished = ex.run(Step("finish", lane=1))
        assert [r.exit_code for _, r in finished.exited] == [0]
        assert [op.id for op in finished.snapshot.operations] == ["op-1"]


def _faultlab(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_mutants_catches_the_private_server_concurrency_mutants_at_their_minimal_traces(
        tmp_path: Path) -> None:
    """``mutants --only ...`` starts a private server of its own per mutant and judges it
    there with two lanes (explore alone: neither is enumerable); at the default budget
    each is caught and shrunk to its minimal trace (the rescue and overtake rules release
    a reference-pg dispatcher, whose first point is inside its claim transaction, until it
    holds its claim)."""
    _require()
    output = tmp_path / "zoo.json"
    done = _faultlab("mutants", "--only", "server-clock-lease-pg", "--only", "advisory-lock-pg",
                     "--corpus", str(tmp_path / "c"), "--output", str(output), timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    rows: Any = {row["system"]: row
                 for row in json.loads(output.read_text(encoding="utf-8"))["systems"]}
    for name, caught_by, minimal in (("server-clock-lease-pg", ["FENCE"], 5),
                                     ("advisory-lock-pg", ["EXCL"], 4)):
        row = rows[name]
        assert row["unjudged"] is None and row["enumerable"] is False, row
        assert row["caught_by"] == caught_by and row["minimal_steps"] == minimal, row
        assert row["ok"] and row["explore_invariants"] == caught_by, row
        assert row["shrunk_steps"] == minimal, row


@pytest.mark.slow
def test_concurrent_explore_of_reference_pg_on_a_private_server_is_clean(
        tmp_path: Path) -> None:
    _require()
    done = _faultlab("explore", "--system", "reference-pg", "--postgres", "private",
                     "--concurrency", "2", "--examples", "30", "--seed", "0", "--quiet",
                     "--corpus", str(tmp_path / "corpus"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "clean" in done.stdout


@pytest.mark.parametrize("wake", [True, False])
def test_the_rescue_rule_lets_the_rescuer_claim_before_the_holder_wakes(
        private: PrivateServer, wake: bool) -> None:
    """A reference-pg dispatcher's first point is inside its claim transaction, where it has
    claimed nothing: when the holder is to wake, the rescue rule draws whether it wakes
    first or superseded, and for the latter (Hypothesis's simplest choice, the only one
    of a derandomized single example) releases the rescuer it started until it holds the
    lapsed claim, as it releases the holder. On server-clock-lease-pg the rule itself then
    shows the defect: the superseded holder completes too (FENCE at its finish). Before,
    the holder always woke while the rescuer waited inside its claim transaction,
    completed first, and nothing was superseded. Without ``wake`` the rescuer stays at its
    first point, and the recovery, which finishes both lanes, shows the same FENCE."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from faultlab.search.machine import InvariantFailure
    from faultlab.search.recorder import Recorder
    from faultlab.search.schedules import concurrent_machine

    machine = concurrent_machine("server-clock-lease-pg", concurrency=2, examples=1, steps=8,
                                 recorder=Recorder())
    seen: list[tuple[list[Step], list[int], str | None, str | None]] = []

    @settings(max_examples=1, database=None, deadline=None, derandomize=True)
    @given(st.data())
    def rescue_once(data: st.DataObject) -> None:
        state = machine()
        in_rule = at_recovery = None
        try:
            state.payloads["op-1"] = PAYLOAD
            state.execute(Step("accept", "op-1", PAYLOAD, lane=1))
            try:
                state.rescue(data, wake)
            except InvariantFailure as failure:
                in_rule = "+".join(sorted({v.invariant for v in failure.violations}))
            claims = [claim.token for claim in state.executor.history.claims]
            steps = [o.step for o in state.executor.observations]
        finally:
            try:
                state.teardown()
            except InvariantFailure as failure:
                at_recovery = "+".join(sorted({v.invariant for v in failure.violations}))
        seen.append((steps, claims, in_rule, at_recovery))

    rescue_once()
    ((steps, claims, in_rule, at_recovery),) = seen
    # with wake, the rescuer's claim superseded the holder's before the holder moved
    assert claims == ([1, 2] if wake else [1]), (claims, steps)
    holder, rescuer = steps[1].lane, steps[4].lane
    assert holder != rescuer
    assert [(s.action, s.lane) for s in steps] == [
        ("accept", 1), ("dispatch", holder), ("release", holder), ("tick", None),
        ("dispatch", rescuer),
        *([("release", rescuer), ("finish", holder)] if wake else [])], steps
    assert (in_rule, at_recovery) == (("FENCE", None) if wake else (None, "FENCE"))
