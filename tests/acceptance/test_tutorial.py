"""The tutorial (docs/tutorial.md), followed as a newcomer follows it.

The tutorial is the first thing a new user runs, and nothing else checks that it still works as
written: a renamed option, a reworded message or a new migration would leave it quietly wrong.
These tests take the files the reader types (``trips.py``, ``create_tables.py``, ``test_trips.py``)
and the commands the reader runs from the tutorial's own text, run them in an empty directory
against ``sqlite:///trips.sqlite3`` with a real worker, and compare what they print with what the
tutorial shows wherever that is deterministic (not saga ids, not timings). Only SQLite is needed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from saga_engine import diagram

DOCS = Path(__file__).resolve().parents[2] / "docs"
SCRIPT = Path(sys.executable).with_name("saga-engine")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "saga_engine.cli"]
#: ``pytest`` as in the reader's empty directory: no ini file, no conftest.py above it, no cache.
PYTEST = [sys.executable, "-m", "pytest", "-c", os.devnull, "--rootdir", ".", "--confcutdir", "."]
PROGRAMS = {
    "saga-engine": COMMAND,
    "python": [sys.executable],
    "pytest": [*PYTEST, "-p", "no:cacheprovider"],
}
DATABASE = "trips.sqlite3"  # the tutorial's sqlite:///trips.sqlite3, in the tutorial's directory

pytestmark = pytest.mark.sqlite


# -- reading the tutorial -------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """A fenced code block and the prose between it and the block before."""

    lang: str
    body: str
    prose: str


@dataclass(frozen=True)
class Shell:
    """A ``$`` command of a console block, as the reader types it, and the output shown under it."""

    argv: tuple[str, ...]
    output: tuple[str, ...]


FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
#: The line above each part of a file the reader creates: **`trips.py`** (2 of 3).
LABEL = re.compile(r"^\*\*`(?P<name>[\w.]+)`\*\*(?: \((?P<part>\d+ of \d+)\))?$")


def blocks(document: Path) -> list[Block]:
    text = document.read_text()
    found, end = [], 0
    for fence in FENCE.finditer(text):
        found.append(Block(fence[1], fence[2], text[end : fence.start()].strip()))
        end = fence.end()
    return found


def source_files(tutorial: list[Block]) -> dict[str, str]:
    """Each file the tutorial says to create: its labelled Python blocks, in order, one after the
    other (the reader adds part 2 of 3 below part 1)."""
    parts: dict[str, list[str]] = {}
    numbers: dict[str, list[str]] = {}  # ["1 of 3", "2 of 3", "3 of 3"], as the labels say
    for block in tutorial:
        label = LABEL.match(block.prose.rsplit("\n", 1)[-1])
        if block.lang == "python" and label is not None:
            parts.setdefault(label["name"], []).append(block.body)
            numbers.setdefault(label["name"], []).append(label["part"] or "1 of 1")
    for name, labels in numbers.items():
        assert labels == [f"{n} of {len(labels)}" for n in range(1, len(labels) + 1)], name
    introduced = {name for b in tutorial for name in re.findall(r"Create `([\w.]+)`", b.prose)}
    assert set(parts) == introduced, "every file the tutorial creates, and only those, is labelled"
    return {name: "\n\n".join(bodies) for name, bodies in parts.items()}


def write_files(tutorial: list[Block], directory: Path) -> dict[str, str]:
    files = source_files(tutorial)
    for name, text in files.items():
        (directory / name).write_text(text)
    return files


def shell_commands(tutorial: list[Block]) -> list[Shell]:
    found = []
    for block in tutorial:
        if block.lang != "console":
            continue
        for chunk in re.split(r"^\$ ", block.body, flags=re.MULTILINE)[1:]:
            lines = chunk.splitlines()
            typed = 1  # lines ending in a backslash go on on the next line
            while lines[typed - 1].endswith("\\"):
                typed += 1
            command = " ".join(line.removesuffix("\\") for line in lines[:typed])
            found.append(Shell(tuple(shlex.split(command)), tuple(lines[typed:])))
    return found


def commands(shells: list[Shell], *prefix: str) -> list[Shell]:
    return [shell for shell in shells if shell.argv[: len(prefix)] == prefix]


# -- running it -----------------------------------------------------------------------------------


def argv(shell: Shell) -> list[str]:
    program, *args = shell.argv
    return [*PROGRAMS[program], *args]


def environment() -> dict[str, str]:
    """This process's environment without the options of the pytest that runs these tests."""
    return {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}


def run(shell: Shell, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv(shell),
        cwd=cwd,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_prints(shell: Shell, cwd: Path) -> None:
    result = run(shell, cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == list(shell.output)


def sqlite_shell(shell: Shell, cwd: Path) -> list[str]:
    """What ``sqlite3 FILE "SQL; ..."`` prints (columns joined by ``|``, NULL as nothing), through
    the sqlite3 module, so the sqlite3 program need not be installed."""
    _, file, script = shell.argv
    with contextlib.closing(sqlite3.connect(cwd / file)) as conn:
        rows = [row for sql in script.split(";") if sql.strip() for row in conn.execute(sql)]
    return ["|".join("" if value is None else str(value) for value in row) for row in rows]


@contextlib.contextmanager
def in_background(shell: Shell, cwd: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The command running as in a second terminal, its output in ``log``; killed should the test
    leave before it stopped."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv(shell), cwd=cwd, env=environment(), stdout=out, stderr=subprocess.STDOUT
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def wait_until_ended(cwd: Path, sagas: int, worker: subprocess.Popen[bytes], log: Path) -> None:
    """Until ``sagas`` have ended and the outbox holds nothing to send ("a second later")."""
    query = """SELECT
        (SELECT count(*) FROM saga_instances WHERE state IN ('COMPLETED', 'COMPENSATED', 'FAILED')),
        (SELECT count(*) FROM outbox_messages WHERE status = 0)"""
    deadline = time.monotonic() + 30
    while True:
        with contextlib.closing(sqlite3.connect(cwd / DATABASE)) as conn:
            ended, pending = conn.execute(query).fetchone()
        if (ended, pending) == (sagas, 0):
            return
        assert worker.poll() is None, f"the worker exited: {log.read_text()}"
        assert time.monotonic() < deadline, f"{ended} of {sagas} sagas ended, {pending} pending"
        time.sleep(0.1)


def stop(worker: subprocess.Popen[bytes]) -> int:
    worker.send_signal(signal.SIGINT)  # Ctrl-C in its terminal
    return worker.wait(30)


def without_timings(lines: Iterable[str]) -> list[str]:
    """The lines with every duration (``13.5 ms``, ``in 18.81s``) made alike."""
    timing = re.compile(r"\b\d+(\.\d+)? ?m?s\b( \(\d+:\d\d:\d\d\))?")
    return [timing.sub("<time>", line) for line in lines]


def started_ids(shells: list[Shell], cwd: Path) -> list[uuid.UUID]:
    """Run each ``saga-engine start``: each prints one id, a UUIDv7 like the tutorial's."""
    ids = []
    for shell in shells:
        result = run(shell, cwd)
        assert result.returncode == 0, result.stderr
        [printed], [shown] = result.stdout.splitlines(), shell.output
        ids.append(uuid.UUID(printed))
        assert ids[-1].version == uuid.UUID(shown).version == 7
    return ids


def assert_is_the_machine_concepts_shows(mermaid: Path) -> None:
    """The states and transitions of the written diagram are those of the concepts guide, which
    the tutorial sends the reader to."""
    [shown] = [b for b in blocks(DOCS / "concepts.md") if "diagrams/book_trip.mmd" in b.prose]

    def machine(text: str) -> list[str]:
        return [line.strip() for line in text.splitlines() if re.match(r"\s*state |.*-->", line)]

    assert machine(mermaid.read_text()) == machine(shown.body)


# -- the tutorial ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_trips_end_as_the_tutorial_shows(tmp_path: Path) -> None:
    """Sections 5 to 8: the database, a worker, four starts, then what ``status``, the tables and
    ``diagram`` show."""
    tutorial = blocks(DOCS / "tutorial.md")
    shells = shell_commands(tutorial)
    write_files(tutorial, tmp_path)

    # 5. The database: the engine's migrations, then the services' tables.
    [upgrade] = commands(shells, "saga-engine", "db", "upgrade")
    assert_prints(upgrade, tmp_path)
    [create_tables] = commands(shells, "python", "create_tables.py")
    assert_prints(create_tables, tmp_path)

    # 6. Run a worker, in the background.
    [worker_command] = commands(shells, "saga-engine", "worker")
    log = tmp_path / "worker.log"
    with in_background(worker_command, tmp_path, log) as worker:
        # 7. Start some trips: three valid ones, then data that is refused.
        *trips, invalid = commands(shells, "saga-engine", "start")
        ids = started_ids(trips, tmp_path)
        assert ids == sorted(ids), "UUIDv7 ids are time-ordered"
        refused = run(invalid, tmp_path)
        assert (refused.returncode, refused.stdout) == (2, "")
        assert refused.stderr.splitlines() == list(invalid.output)

        # 8. See what happened, once every saga has ended.
        wait_until_ended(tmp_path, len(trips), worker, log)
        [status] = commands(shells, "saga-engine", "status")
        shown = run(status, tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert without_timings(shown.stdout.splitlines()) == without_timings(status.output)
        for query in commands(shells, "sqlite3"):
            assert sqlite_shell(query, tmp_path) == list(query.output), query.argv[-1]

        [draw] = commands(shells, "saga-engine", "diagram")
        drawn = run(draw, tmp_path)
        assert drawn.returncode == 0, drawn.stderr
        svg = diagram.svg_available()  # "drawn only when Graphviz is installed"
        paths = [path for path in draw.output if svg or not path.endswith(".svg")]
        assert drawn.stdout.splitlines() == paths
        assert all((tmp_path / path).stat().st_size > 0 for path in paths)
        assert_is_the_machine_concepts_shows(tmp_path / "diagrams" / "book_trip.mmd")
        assert not svg or "<svg" in (tmp_path / "diagrams" / "book_trip.svg").read_text()

        assert stop(worker) == 0
    assert log.read_text() == "", "the worker runs quietly: warnings and errors only"


def test_a_step_without_its_compensation_fails_at_import(tmp_path: Path) -> None:
    """Section 4: remove the ``.compensate(...)`` of ``reserve_room``; importing trips fails."""
    tutorial = blocks(DOCS / "tutorial.md")
    trips = source_files(tutorial)["trips.py"]
    broken, removed = re.subn(r'(step\("reserve_room"\).*)\.compensate\([^)]*\)', r"\1", trips)
    assert removed == 1
    (tmp_path / "trips.py").write_text(broken)

    result = subprocess.run(
        [sys.executable, "-c", "import trips"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    [error] = [b.body for b in tutorial if '`python -c "import trips"`' in b.prose]
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == error.strip()


@pytest.mark.slow
def test_the_property_test_passes(tmp_path: Path) -> None:
    """Section 9: ``pytest -q test_trips.py`` in the tutorial's directory, fifty fault schedules."""
    tutorial = blocks(DOCS / "tutorial.md")
    write_files(tutorial, tmp_path)
    [pytest_command] = commands(shell_commands(tutorial), "pytest")

    result = run(pytest_command, tmp_path, timeout=240)

    def squeezed(lines: Iterable[str]) -> list[str]:  # the progress line fills the terminal
        return [" ".join(line.split()) for line in without_timings(lines)]

    assert result.returncode == 0, result.stdout + result.stderr
    assert squeezed(result.stdout.splitlines()) == squeezed(pytest_command.output)


#: The schedule a failing property prints, pasted into a script (docs/testing.md, "Replaying a
#: schedule") to run it again.
REPLAY = """
from saga_engine.testing import *  # the faults the schedule names
from test_trips import TRIPS, trip_invariants
from trips import app, book_trip

simulate(app, book_trip, TRIPS, {schedule}).assert_invariants(domain=trip_invariants)
"""


def test_a_broken_compensation_fails_as_the_tutorial_shows(tmp_path: Path) -> None:
    """Section 9: with ``pass`` for the body of ``cancel_room``, the schedule the tutorial says
    Hypothesis finds breaks the trips as shown. (Hypothesis's own search and shrinking take over a
    minute; replaying what it found takes a second.)"""
    tutorial = blocks(DOCS / "tutorial.md")
    files = write_files(tutorial, tmp_path)
    body = r"(def cancel_room\(.*\) -> None:\n)(?:    .*\n|\n(?=    ))+"
    broken, replaced = re.subn(body, r"\1    pass\n", files["trips.py"])
    assert replaced == 1
    (tmp_path / "trips.py").write_text(broken)
    [failure] = [b.body for b in tutorial if b.body.startswith("E ")]  # what pytest reports
    reported = textwrap.dedent("\n".join(line.removeprefix("E") for line in failure.splitlines()))
    message = reported.split("\nFailing test case:")[0]
    schedule = message.splitlines()[0].removeprefix("AssertionError: ").removesuffix(":")

    result = subprocess.run(
        [sys.executable, "-c", REPLAY.format(schedule=schedule)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 1, result.stderr
    shown = message.splitlines()
    assert result.stderr.splitlines()[-len(shown) :] == shown
