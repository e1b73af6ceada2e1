"""The nemesis: everything that kills a worker process at a defined point.

Jepsen's word for the fault injector. faultlab's faults are real: a process
SIGKILLed at a named point, never an exception or a flag.

* :mod:`faultlab.nemesis.crash`: the worker kills itself at a named point its
  system declares, or at ``sql:K`` / ``commit:K`` (faultlab's own worker
  processes, which trace their SQLite statements);
* :mod:`faultlab.nemesis.announce`: a command-line worker announces each point it
  reaches and waits; faultlab kills it from outside at the armed one.

A worker is also SIGKILLed, paused (SIGSTOP) and resumed (SIGCONT) from outside,
in a concurrent trace's lanes: :mod:`faultlab.run.interleaving` sends those signals.
"""
