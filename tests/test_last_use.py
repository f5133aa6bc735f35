"""A resource shared through ``last_use`` ends after the last test that uses it, in a real pytest
run (a child process) with the hooks tests/conftest.py imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CONFTEST = """
import os
import pytest
from last_use import LastUse
from last_use import pytest_collection_finish, pytest_runtest_teardown, pytest_sessionfinish

def note(text):
    with open(os.environ["LAST_USE_LOG"], "a") as log:
        log.write(text + "\\n")

RESOURCE = LastUse("resource", lambda: note("start") or "the resource", lambda r: note("stop"))

@pytest.fixture
def resource():
    return RESOURCE.get()

@pytest.fixture
def user_teardown(resource):
    yield
    note("fixture teardown")
"""

FILES = {
    "test_1_users.py": """
from conftest import note

def test_one(resource):
    note("one")

def test_two(resource, user_teardown):
    note("two")
""",
    "test_2_others.py": """
from conftest import note

def test_three():
    note("three")
""",
    "test_3_last_user.py": """
from conftest import note

def test_four(resource):
    note("four")

def test_five():
    note("five")
""",
}


def run(tmp_path: Path, *args: str, code: int = 0) -> list[str]:
    """Run pytest on the files above in ``tmp_path``; what the tests and the resource noted."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    log = tmp_path / "log.txt"
    env = dict(os.environ, LAST_USE_LOG=str(log), PYTHONPATH=str(TESTS))
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*argv, "--rootdir", str(tmp_path), *args, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == code, done.stdout + done.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_the_resource_ends_after_its_last_user_not_at_the_end_of_the_session(
    tmp_path: Path,
) -> None:
    assert run(tmp_path) == [
        "start",
        "one",
        "two",
        "fixture teardown",
        "three",
        "four",
        "stop",  # after test_four, before test_five
        "five",
    ]


def test_with_the_later_users_deselected_it_ends_after_the_last_one_selected(
    tmp_path: Path,
) -> None:
    # The users' own fixtures end first: they may still need the resource.
    assert run(tmp_path, "-k", "not four") == [
        "start",
        "one",
        "two",
        "fixture teardown",
        "stop",
        "three",
        "five",
    ]


def test_a_run_with_no_user_never_starts_it(tmp_path: Path) -> None:
    assert run(tmp_path, "-k", "three or five") == ["three", "five"]


def test_a_run_stopped_before_the_last_user_still_ends_it(tmp_path: Path) -> None:
    (tmp_path / "test_0_fails.py").write_text(
        "from conftest import note\n\ndef test_zero(resource):\n    note('zero')\n    assert 0\n"
    )
    assert run(tmp_path, "-x", code=1) == ["start", "zero", "stop"]
