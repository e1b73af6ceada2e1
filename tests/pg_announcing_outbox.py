"""examples/postgres_outbox/outbox.py announcing its crash points (the announcement
protocol of faultlab.nemesis.announce) instead of taking ``--crash``: a lane holds it at
every point it reaches, its transaction open. Run as ``pg_announcing_outbox.py
EXAMPLE_DIR ROLE ...``; no faultlab import, as a command-line system's program."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, sys.argv.pop(1))  # the example's directory
import outbox  # noqa: E402


def reached(point: str, armed: str | None) -> None:
    """Say ``reached POINT PID`` and wait for the answer (faultlab SIGKILLs the process
    group instead of answering when the point is armed)."""
    announce = os.environ.get("FAULTLAB_ANNOUNCE_FD")
    resume = os.environ.get("FAULTLAB_RESUME_FD")
    if not (announce and resume):
        return
    os.write(int(announce), f"reached {point} {os.getpid()}\n".encode())
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = os.read(int(resume), 1)
        if not chunk:  # faultlab went away: carry on
            break
        reply += chunk


outbox.reached = reached
sys.exit(outbox.main())
