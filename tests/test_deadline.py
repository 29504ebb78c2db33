"""The time budget for pure-Python work (barrel.pipeline.deadline): it stops endless work,
and it leaves nothing behind in the interpreter, whether it ran out or not.

Each case runs in a fresh interpreter: what a budget can leave behind (CPython's "async
exception pending" flag) is process-wide and would leak into every later test. Under a
trace function a flag left up makes the next call spin for ever, so "the traced call
returned" is what each case waits for."""

from __future__ import annotations

import subprocess
import sys
import textwrap

TRACED_CALL = """
import sys
def traced():
    return sum(i for i in range(10))
sys.settrace(lambda *a: None)
assert traced() == 45
sys.settrace(None)
print("traced call returned")
"""


def run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code) + TRACED_CALL],
        capture_output=True,
        text=True,
        timeout=300,  # safety net: a process that spins for ever fails here
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_budget_that_was_enough_leaves_traced_code_running() -> None:
    out = run(
        """
        from barrel.pipeline.deadline import budget
        with budget(30.0):
            total = sum(range(1000))
        print("block done", total)
        """
    )
    assert out.splitlines() == ["block done 499500", "traced call returned"]


def test_an_endless_loop_is_stopped_and_traced_code_runs_after_it() -> None:
    out = run(
        """
        from barrel.pipeline.deadline import Expired, budget
        try:
            with budget(0.2):
                while True:
                    pass
        except Expired:
            print("expired")
        """
    )
    assert out.splitlines() == ["expired", "traced call returned"]


def test_a_budget_that_runs_out_inside_a_c_call_does_not_leak_into_later_work() -> None:
    out = run(
        """
        import threading, time
        from barrel.pipeline.deadline import Expired, budget
        try:
            with budget(0.05):
                threading.Event().wait(0.5)  # C, past the budget
        except Expired:
            print("expired")
        # the same thread, later work: nothing left to land here
        for _ in range(100000):
            pass
        time.sleep(0.3)
        print("later work done")
        """
    )
    assert out.splitlines() == ["expired", "later work done", "traced call returned"]


def test_many_budgets_in_a_row_leave_nothing_behind() -> None:
    out = run(
        """
        from barrel.pipeline.deadline import budget
        for i in range(200):
            with budget(30.0):
                pass
        print("200 blocks")
        """
    )
    assert out.splitlines() == ["200 blocks", "traced call returned"]
