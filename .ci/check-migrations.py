#!/usr/bin/env python3
"""Fails when a migration would break the binary that is already running.

Usage: check-migrations.py [--base REV] [--all]
       check-migrations.py --self-test

During a rolling update the previous binary keeps serving on the schema the new one has
migrated (docs/upgrading.md), and a rollback runs the previous binary on it for good. So
migrations are expand-only, and sqlx refuses to start on a database whose applied
migration's file has changed (it keeps each one's checksum). Two checks, over
migrations/sqlite/ and migrations/postgres/:

1. No migration file of the base was edited, renamed or deleted (compared byte for
   byte with the working tree).
2. Every migration file that is new since the base drops or renames nothing the previous
   binary reads: no DROP TABLE, no dropped column (DROP COLUMN, or ALTER TABLE … DROP c),
   no RENAME, no column type changed (ALTER COLUMN … TYPE / SET DATA TYPE), no NOT NULL
   put on an existing column (SET NOT NULL), no default dropped (DROP DEFAULT), no
   column added NOT NULL without a DEFAULT (the previous binary's INSERTs leave it out),
   and no DROP INDEX / TRIGGER / VIEW / FUNCTION unless the same file creates one of that
   name again (replacing a trigger to watch a new column is how columns are added here).
   Comments and quoted strings are not read as SQL.

The base, which the script prints: --base REV when given; else, on a branch, where it
left `origin/main` (`git merge-base HEAD origin/main`; `main` in a repository without
that remote), so that everything the branch adds is checked; else — on main itself, as
CI runs it on a fresh clone, where HEAD is `origin/main` — the previous commit (HEAD~1),
so each commit to main is checked as it lands. A repository with a single commit has no base: nothing
to compare, and the script says so and passes. --all checks every migration file's
statements as if it were new (the base's files are checked for edits either way).
--self-test builds throw-away git repositories (one cloned, to have an `origin/main`)
and checks that good migrations pass and each kind of bad one fails. Problems are
printed as `file:line: problem`; the exit status is 1 if there is any.
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIRS = ("migrations/sqlite", "migrations/postgres")

# A name, possibly quoted or schema-qualified.
NAME = r'(?:"[^"]+"|\w+)(?:\.(?:"[^"]+"|\w+))?'
REPLACEABLE = ("INDEX", "TRIGGER", "VIEW", "FUNCTION")


def git(*args, cwd=ROOT, check=True):
    done = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    if check and done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done


def base_of(cwd):
    """The revision to compare with and why, or (None, why) when there is none."""
    head = git("rev-parse", "HEAD", cwd=cwd).stdout.strip()
    for main in ("origin/main", "main"):
        found = git("rev-parse", "--verify", "-q", main, cwd=cwd, check=False)
        if found.returncode != 0:
            continue
        if found.stdout.strip() == head:
            break
        base = git("merge-base", "HEAD", main, cwd=cwd, check=False)
        if base.returncode == 0:
            return base.stdout.strip(), f"where this branch left {main}"
    parent = git("rev-parse", "--verify", "-q", "HEAD~1", cwd=cwd, check=False)
    if parent.returncode == 0:
        return parent.stdout.strip(), "the previous commit (HEAD~1)"
    return None, "no previous commit"


def blank_out(sql):
    """`sql` with comments and quoted strings replaced by spaces (newlines kept), so
    that line numbers still match and nothing inside them reads as a statement."""
    out, i, n = [], 0, len(sql)
    while i < n:
        if sql.startswith("--", i):
            end = sql.find("\n", i)
            end = n if end < 0 else end
        elif sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            end = n if end < 0 else end + 2
        elif sql[i] == "'":
            end = i + 1
            while end < n:
                if sql[end] == "'" and sql.startswith("''", end):
                    end += 2
                elif sql[end] == "'":
                    end += 1
                    break
                else:
                    end += 1
        elif sql[i] == "$" and (m := re.match(r"\$(\w*)\$", sql[i:])):
            # A PostgreSQL dollar-quoted body: its statements run when the function
            # does, not now; only its name matters here, and that is outside.
            tag = m.group(0)
            end = sql.find(tag, i + len(tag))
            end = n if end < 0 else end + len(tag)
        else:
            out.append(sql[i])
            i += 1
            continue
        out.append(re.sub(r"[^\n]", " ", sql[i:end]))
        i = end
    return "".join(out)


def statement_problems(sql):
    """(offset, problem) for each statement of `sql` that would break the previous
    binary."""
    text = blank_out(sql)
    found = []

    def each(pattern, problem):
        for m in re.finditer(pattern, text, re.I):
            found.append((m.start(), problem))

    each(r"\bDROP\s+TABLE\b", "DROP TABLE: the previous binary reads that table")
    each(r"\bRENAME\b", "RENAME: the previous binary reads the old name")
    each(
        r"\bALTER\s+(?:COLUMN\s+)?" + NAME + r"\s+(?:SET\s+DATA\s+)?TYPE\b",
        "a column's type changed: the previous binary reads the old type",
    )
    each(
        r"\bSET\s+NOT\s+NULL\b",
        "NOT NULL put on an existing column: the previous binary may write NULL there",
    )
    each(
        r"\bDROP\s+DEFAULT\b",
        "a default dropped: the previous binary's INSERTs rely on it",
    )
    for statement in re.finditer(r"\bALTER\s+TABLE\b[^;]*", text, re.I):
        for clause in re.finditer(
            r"\bDROP\s+(?!CONSTRAINT\b|NOT\s+NULL\b|DEFAULT\b)(?:COLUMN\s+)?",
            statement.group(0),
            re.I,
        ):
            found.append(
                (
                    statement.start() + clause.start(),
                    "a column dropped: the previous binary reads it",
                )
            )
        for clause in re.finditer(
            r"\bADD\s+(?:COLUMN\s+)?(?!CONSTRAINT\b)[^,;]*", statement.group(0), re.I
        ):
            said = clause.group(0)
            if re.search(r"\bNOT\s+NULL\b", said, re.I) and not re.search(
                r"\bDEFAULT\b", said, re.I
            ):
                found.append(
                    (
                        statement.start() + clause.start(),
                        "a column added NOT NULL without a DEFAULT: the previous "
                        "binary's INSERTs leave it out",
                    )
                )
    for m in re.finditer(
        r"\bDROP\s+(" + "|".join(REPLACEABLE) + r")\s+(?:IF\s+EXISTS\s+)?(" + NAME + ")",
        text,
        re.I,
    ):
        kind, name = m.group(1).upper(), m.group(2)
        created = (
            r"\bCREATE\s+(?:OR\s+REPLACE\s+)?(?:UNIQUE\s+)?"
            + kind
            + r"\s+(?:IF\s+NOT\s+EXISTS\s+)?"
            + re.escape(name)
            + r"(?![\w\"])"
        )
        if not re.search(created, text[m.end():], re.I):
            found.append(
                (
                    m.start(),
                    f"DROP {kind} {name} without creating it again: the previous "
                    "binary may rely on it",
                )
            )
    return sorted(found)


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


def check(cwd, base, check_all):
    """The problems, as `file:line: problem` lines."""
    problems = []
    before = {}
    if base:
        listed = git("ls-tree", "-r", "--name-only", base, "--", *DIRS, cwd=cwd).stdout
        before = {path for path in listed.split("\n") if path.endswith(".sql")}
    now = {
        str(path.relative_to(cwd))
        for d in DIRS
        if (cwd / d).is_dir()
        for path in sorted((cwd / d).glob("*.sql"))
    }
    for path in sorted(before):
        if path not in now:
            problems.append(
                f"{path}: deleted or renamed: sqlx refuses a database on which it ran"
            )
            continue
        old = subprocess.run(
            ["git", "show", f"{base}:{path}"], cwd=cwd, capture_output=True, check=True
        ).stdout
        if (cwd / path).read_bytes() != old:
            problems.append(
                f"{path}: edited after it was committed: sqlx refuses every database on "
                "which it ran (checksum mismatch); add a new migration instead"
            )
    for path in sorted(now):
        if path in before and not check_all:
            continue
        sql = (cwd / path).read_text()
        for offset, problem in statement_problems(sql):
            problems.append(f"{path}:{line_of(sql, offset)}: {problem}")
    return problems


def self_test():
    """Good migrations pass and each kind of bad one fails, in throw-away repositories."""
    good = {
        "plain column": "ALTER TABLE t ADD COLUMN b INTEGER;",
        "NOT NULL with a default": "ALTER TABLE t ADD COLUMN b INTEGER NOT NULL DEFAULT 0;",
        "a trigger replaced": "DROP TRIGGER t_feed;\nCREATE TRIGGER t_feed AFTER UPDATE ON t BEGIN SELECT 1; END;",
        "an index replaced": "DROP INDEX IF EXISTS t_a;\nCREATE INDEX t_a ON t (a, b);",
        "words in comments and strings": "-- DROP TABLE t; RENAME\nINSERT INTO t (a) VALUES ('DROP COLUMN a');",
        "a constraint dropped": "ALTER TABLE t DROP CONSTRAINT t_check;",
        "NOT NULL lifted": "ALTER TABLE t ALTER COLUMN a DROP NOT NULL;",
        "a new table": "CREATE TABLE u (id INTEGER PRIMARY KEY, a TEXT NOT NULL);",
    }
    bad = {
        "DROP TABLE": "DROP TABLE t;",
        "DROP COLUMN": "ALTER TABLE t DROP COLUMN a;",
        "ALTER TABLE … DROP": "ALTER TABLE t DROP a;",
        "RENAME COLUMN": "ALTER TABLE t RENAME COLUMN a TO b;",
        "RENAME TO": "ALTER TABLE t RENAME TO u;",
        "ALTER COLUMN TYPE": "ALTER TABLE t ALTER COLUMN a TYPE BIGINT;",
        "SET DATA TYPE": "ALTER TABLE t ALTER COLUMN a SET DATA TYPE TEXT;",
        "SET NOT NULL": "ALTER TABLE t ALTER COLUMN a SET NOT NULL;",
        "NOT NULL without a default": "ALTER TABLE t ADD COLUMN b INTEGER NOT NULL;",
        "an index dropped": "DROP INDEX t_a;",
        "a default dropped": "ALTER TABLE t ALTER COLUMN a DROP DEFAULT;",
    }
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        upstream = Path(tmp) / "upstream"
        env = {
            **os.environ,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@example.org",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@example.org",
        }

        def run(cwd, *args):
            subprocess.run(
                ["git", *args], cwd=cwd, env=env, check=True, capture_output=True
            )

        (upstream / "migrations/sqlite").mkdir(parents=True)
        run(upstream, "init", "-q", "-b", "main")
        first = upstream / "migrations/sqlite/0001_t.sql"
        first.write_text("CREATE TABLE t (id INTEGER PRIMARY KEY, a INTEGER);\n")
        run(upstream, "add", "-A")
        run(upstream, "commit", "-q", "-m", "0001")
        (upstream / "README").write_text("a commit without a migration\n")
        run(upstream, "add", "-A")
        run(upstream, "commit", "-q", "-m", "readme")
        clone = Path(tmp) / "clone"
        run(tmp, "clone", "-q", str(upstream), str(clone))

        def outcome(repo, name, sql, commit):
            """The problems of `repo` with `sql` as a new migration (committed or not)."""
            new = repo / "migrations/sqlite/0002_new.sql"
            new.write_text(sql + "\n")
            if commit:
                run(repo, "add", "-A")
                run(repo, "commit", "-q", "-m", name)
            base, _ = base_of(repo)
            problems = check(repo, base, False)
            if commit:
                run(repo, "reset", "-q", "--hard", "HEAD~1")
            new.unlink(missing_ok=True)
            return problems

        # On main as CI clones it (HEAD is origin/main: compared with HEAD~1, which has
        # 0001), the migration committed; on a branch (compared with origin/main), not.
        run(clone, "checkout", "-q", "-b", "feature")
        for where, repo, commit in (("main", upstream, True), ("branch", clone, False)):
            if where == "main":
                base, _ = base_of(repo)
                if base != git("rev-parse", "HEAD~1", cwd=repo).stdout.strip():
                    failures.append("on main the base is not HEAD~1")
            for name, sql in good.items():
                if problems := outcome(repo, name, sql, commit):
                    failures.append(f"{where}: {name} refused: {problems}")
            for name, sql in bad.items():
                if not outcome(repo, name, sql, commit):
                    failures.append(f"{where}: {name} passed")
        if check(clone, base_of(clone)[0], False):
            failures.append("a clean branch has problems")

        # A committed migration edited, or deleted, on the branch.
        first_in_clone = clone / "migrations/sqlite/0001_t.sql"
        saved = first_in_clone.read_text()
        first_in_clone.write_text(saved + "-- a comment is an edit too\n")
        if not any("edited" in p for p in check(clone, base_of(clone)[0], False)):
            failures.append("an edited migration passed")
        first_in_clone.unlink()
        if not any("deleted" in p for p in check(clone, base_of(clone)[0], False)):
            failures.append("a deleted migration passed")
        first_in_clone.write_text(saved)

        # A branch that commits a bad migration and then more: still compared with
        # where it left origin/main, not with its previous commit.
        (clone / "migrations/sqlite/0002_new.sql").write_text("DROP TABLE t;\n")
        run(clone, "add", "-A")
        run(clone, "commit", "-q", "-m", "bad")
        (clone / "README").write_text("later\n")
        run(clone, "commit", "-q", "-am", "later")
        if not check(clone, base_of(clone)[0], False):
            failures.append("a bad migration two commits back on a branch passed")
    for failure in failures:
        print(f"self-test: {failure}")
    if failures:
        return 1
    print(f"self-test: {len(good)} good migrations pass, {len(bad)} bad ones and edits fail")
    return 0


def main(args):
    if args == ["--self-test"]:
        return self_test()
    check_all = "--all" in args
    args = [a for a in args if a != "--all"]
    if len(args) == 2 and args[0] == "--base":
        base = git("rev-parse", "--verify", args[1]).stdout.strip()
        why = f"--base {args[1]}"
    elif not args:
        base, why = base_of(ROOT)
    else:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    if base is None:
        print(f"check-migrations: {why}: no base to compare with, nothing to check")
        if not check_all:
            return 0
    else:
        print(f"check-migrations: compared with {base[:12]} ({why})")
    problems = check(ROOT, base, check_all)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
