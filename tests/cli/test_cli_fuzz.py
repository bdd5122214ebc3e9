"""Generated `poolctl` argument vectors: every refusal is one clean line, a documented code, no change.

Runs ``poolkeeper.cli.main`` in-process (a subprocess per vector would take minutes) against
initialised SQLite files, with arguments drawn from the command names, their options, and the
classes of bad input: huge and negative numbers, lone surrogates, NUL, empty and long strings,
JSON with NaN or Infinity. ``poolctl child`` runs with a grant's environment and a server URL
where nothing listens (one try: it exits 69 at once). Commands that start servers or processes
(``demo``, ``serve``, ``worker``) are left out.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from poolkeeper.cli import main
from poolkeeper.workerhost.client import PoolClient
from tests.properties import budget

CODES = {0, 1, 2, 69, 75, 78}
EXAMPLES = int(os.environ.get("POOL_CLI_FUZZ_EXAMPLES", "1000"))
COMMANDS = [
    [],
    ["--version"],
    ["init"],
    ["status"],
    ["rows"],
    ["requeue"],
    ["abandon"],
    ["maintain"],
    ["token"],
    ["board", "add"],
    ["board", "list"],
    ["board", "cancel"],
    ["board", "unblock"],
]
CHILD_COMMANDS = [["child", "register"], ["child", "heartbeat"], ["child", "result"], ["child", "vanished"]]
OPTIONS = [
    "--json", "--once", "--state", "--quarantined", "--limit", "--reason", "--body", "--lane",
    "--id", "--status", "--ordinal", "--operator", "--help", "-x", "--",
    "--receipt", "--payload", "--child", "--under", "--key",
]  # fmt: skip
words = st.one_of(
    st.sampled_from(OPTIONS),
    st.sampled_from(["b", "t1", "1", "0", "-1", "pool", "assigned", "done", "running", "{}", '{"a":']),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.text(max_size=40),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),
    st.just("x" * 70_000),
    st.just("a\x00b"),
)
UNSENDABLE = [
    '{"a": NaN}', '{"a": [Infinity]}', '{"a": -Infinity}', '{"a": 1e999}', "[" * 5000, '{"token": "x"}',
]  # fmt: skip
documents = st.sampled_from([*UNSENDABLE, '{"a": ' + "9" * 5000 + "}", '{"a": 1}', "run:1/child:" + "0" * 12])
DOCUMENT_OPTION = {"heartbeat": "--receipt", "result": "--payload"}
child_options = st.sampled_from(["--receipt", "--payload", "--child", "--under", "--key"])
vectors = st.one_of(
    st.tuples(st.sampled_from(COMMANDS), st.lists(words, max_size=5)).map(lambda t: [*t[0], *t[1]]),
    st.tuples(  # a child command, an option with a JSON document or an id, then anything
        st.sampled_from(CHILD_COMMANDS),
        child_options,
        st.one_of(documents, words),
        st.lists(words, max_size=2),
    ).map(lambda t: [*t[0], t[1], t[2], *t[3]]),
)


def dump(path: Path) -> dict[str, Any]:
    """Every table of both databases, as rows: what a refusal must leave as it was."""
    out: dict[str, Any] = {}
    for name in ("pool.db", "board.db"):
        with sqlite3.connect(path / name) as conn:
            tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            for table in tables:
                out[f"{name}:{table}"] = sorted(map(repr, conn.execute(f"SELECT * FROM {table}")))
    return out


@pytest.mark.filterwarnings("ignore")
@pytest.mark.property
def test_generated_argument_vectors_are_refused_cleanly_and_change_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for var, value in {
        "POOL_DATABASE_URL": f"sqlite:///{tmp_path}/pool.db",
        "POOL_BOARD_URL": f"sqlite:///{tmp_path}/board.db",
        "POOL_REDIS_URL": "",
        # a grant's environment for `poolctl child`; nothing listens on port 9
        "POOL_WORKER_URL": "http://127.0.0.1:9",
        "POOL_CHILD_TOKEN": "c1.1." + "0" * 64,
        "POOL_ROW_ID": "1",
        "POOL_ATTEMPT": "1",
        "POOL_FENCE": "1",
        "POOL_OWNER": "w",
        "POOL_CHILD_ID": "run:1/child:" + "0" * 12,
    }.items():
        monkeypatch.setenv(var, value)
    defaults = PoolClient.__init__.__kwdefaults__
    assert defaults is not None
    monkeypatch.setitem(defaults, "tries", 1)  # refused at once: no backoff
    for var in ("POOLCTL_DEBUG", "POOL_SERVER_SECRET", "POOL_SERVER_SECRET_FILE"):
        monkeypatch.delenv(var, raising=False)

    def poolctl(argv: list[str]) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["poolctl", *argv])
        try:
            main()
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        else:
            code = 0
        got = capsys.readouterr()
        return code, got.out, got.err

    assert poolctl(["init"])[0] == 0
    assert poolctl(["board", "add", "b", "seed", "--id", "t1"])[0] == 0
    seen: dict[int, int] = {}

    @budget(EXAMPLES, database=None, suppress=(HealthCheck.function_scoped_fixture,))
    @given(vectors)
    def refuse_cleanly(argv: list[str]) -> None:
        before = dump(tmp_path)
        code, out, err = poolctl(argv)
        seen[code] = seen.get(code, 0) + 1
        assert code in CODES, (argv, code, err)
        assert "Traceback" not in err and "internal error" not in err, (argv, err)
        if _sends_unsendable(argv):  # refused as bad input before any request, not sent and judged later
            assert code in (0, 2), (argv, code, err)  # 0: --help
        if code == 2 and not err:  # no command at all: the help, on stdout
            assert "Usage" in out, (argv, out)
        elif code != 0:
            lines = [line for line in err.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("poolctl: "), (argv, err)
            assert dump(tmp_path) == before, f"a refused {argv!r} changed the databases"

    refuse_cleanly()
    print("exit codes seen:", seen)
    assert seen.get(2, 0) > 0 and seen.get(0, 0) > 0, seen  # both answers were reached


def _sends_unsendable(argv: list[str]) -> bool:
    """A `poolctl child` vector whose JSON option (the last of it given) is a document no server takes."""
    option = DOCUMENT_OPTION.get(argv[1]) if argv[:1] == ["child"] and len(argv) > 1 else None
    if option is None or "--" in argv:
        return False
    given = [argv[i + 1] for i in range(2, len(argv) - 1) if argv[i] == option]
    return bool(given) and given[-1] in UNSENDABLE
