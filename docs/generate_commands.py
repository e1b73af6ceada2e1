"""Write docs/reference/commands.md from the command line's own ``--help`` output.

Run from the repository root after changing a command or an option::

    python docs/generate_commands.py

Every fact on the page (usage, options, defaults, exit statuses) is taken from
``python -m faultlab COMMAND --help``; only the introduction is written here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "commands.md"
COMMANDS = ["suite", "explore", "replay", "enumerate", "mutants", "corpus export",
            "corpus status", "systems", "init", "worker"]

INTRO = """\
# Commands

Every command is `python -m faultlab COMMAND` (or `faultlab COMMAND` once
installed), and `python -m faultlab COMMAND --help` prints what this page
shows. This page is generated from that output by `docs/generate_commands.py`.

Common to every command:

- every command that prints a table takes `--format FMT` (tabulate's
  `tablefmt`: `simple`, `plain`, `github`, ...);
- every command that runs workers takes `--spawn fork|exec` and `--deadline
  SECONDS` (`suite --deadline` reaches the five scenarios' workers too);
- every command that runs a system's workers (`suite`, `explore`,
  `enumerate`, `replay`) takes `--postgres DSN` for systems whose stores are
  PostgreSQL databases
  ([PostgreSQL](../guide/postgres.md));
- `--system` takes a built-in name (`reference`, a mutant; `python -m faultlab
  systems` lists them), a Python system as `package.module:attribute`, or a
  command-line system as `path/to/system.json`
  ([Bring your own system](../guide/own-system.md));
- bad input is one line on stderr, exit status 2, and nothing is created,
  changed or deleted ([Exit statuses](exit-statuses.md)).

## Output files

`--output`, `--html`, `--corpus` and `--directory` are checked before any work
starts: a path that exists and is not a regular file (a FIFO, a device, a
directory) is refused, as is a directory where no file can be created (tried
for real: `os.access` tells root that `/proc` is writable). A symbolic link is
written through (its target is replaced, the link stays); a link to nothing is
refused. Files are written to a temporary file beside the target and renamed,
with the mode an ordinary write would give them (the replaced file's mode, or
`0666` less the umask).

faultlab never replaces a file that is not its own output. An existing file is
replaced only when its first bytes show it is what that option writes:

| option | replaces only |
| --- | --- |
| `suite --output` | a suite evidence file (its first key is `"experiment": "two-store outbox crash recovery (faultlab suite)"`) |
| `mutants --output` | a mutants results file (it begins with `passed` and the `budget`: `examples`, `steps`, `seed`, `operations`, `crashes`, `spawn`) |
| `replay --html`, `explore --html` | a faultlab HTML page (`<meta name="generator" content="faultlab">`, or a page written before that tag) |

Anything else (another program's file, a trace, faultlab's output of another
kind, an empty file) is refused before any work starts with one line, exit 2,
nothing created, changed or deleted; remove it or give another path:

```text
faultlab: error: --html notes.md: exists and is not a faultlab HTML page; refusing to replace it
```

A file that appears at the path while the run goes on is checked again when the
output is written and left alone; a line on stderr says so.

## `replay --against`

`replay --against SYSTEM` runs each trace on another system and expects it to
be clean: a finding from a broken variant replayed against the fixed one must
pass. A trace that arms a crash point only the variant declares (say
`accept_between_commits`) is refused for a system that does not declare it; the
`commit:K` form of the same trace replays anywhere.

## Running one worker by hand

`worker` is the command exec mode spawns for each worker (and a way to run one
role by hand on stores `init` made). It keeps its own exit statuses: 0, 2 bad
input, 3 `payload_conflict`, 4 `downstream_failure`, -9 when the armed crash
point fires.
"""


def help_text(command: str) -> str:
    env = {**os.environ, "COLUMNS": "100"}
    result = subprocess.run([sys.executable, "-m", "faultlab", *command.split(), "--help"],
                            capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    return result.stdout


def sections(text: str) -> tuple[str, str, dict[str, list[str]]]:
    """Usage, description, and the named sections (options, positional arguments, ...)."""
    blocks = re.split(r"\n\n+(?=\S)", text.strip("\n"))
    usage = blocks[0]
    description = ""
    named: dict[str, list[str]] = {}
    for block in blocks[1:]:
        first, _, rest = block.partition("\n")
        if first.endswith(":") and not first.startswith(" "):
            named[first[:-1]] = rest.splitlines()
        elif first.startswith("exit status:"):
            named["exit status"] = [first[len("exit status:"):].strip(), *rest.splitlines()]
        else:
            description = (description + " " + " ".join(block.split())).strip()
    return usage, description, named


def entries(lines: list[str]) -> list[tuple[str, str]]:
    """argparse's two-column listing as (term, help) pairs."""
    found: list[tuple[str, str]] = []
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= 4 and line.strip():
            term, _, rest = line.strip().partition("  ")
            found.append((term, rest.strip()))
        elif found:
            term, rest = found[-1]
            found[-1] = (term, (rest + " " + line.strip()).strip())
    return found


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def page() -> str:
    out = [INTRO]
    for command in COMMANDS:
        usage, description, named = sections(help_text(command))
        out.append(f"## `{command}`\n")
        if description:
            out.append(description + "\n")
        out.append("```text\n" + usage + "\n```\n")
        for title in ("positional arguments", "options"):
            rows = [(t, h) for t, h in entries(named.get(title, []))
                    if t not in ("-h, --help",)]
            if not rows:
                continue
            out.append(f"| {title[:-1] if title.endswith('s') else title} | meaning |")
            out.append("| --- | --- |")
            for term, help_ in rows:
                out.append(f"| `{cell(term)}` | {cell(help_) or '-'} |")
            out.append("")
        if "exit status" in named:
            status = "\n".join(line.rstrip() for line in named["exit status"] if line.strip())
            out.append("Exit status:\n\n```text\n" + status + "\n```\n")
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    PAGE.write_text(page())
    print(f"wrote {PAGE.relative_to(ROOT)}")
