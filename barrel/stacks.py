"""SIGUSR1 writes every thread's stack to stderr, even while the event loop is stuck.

A thread of its own waits for the signal with sigwait and dumps with the GIL held.
faulthandler's own signal handler walks the thread list from inside the signal, without
the GIL, and can crash the daemon when the signal lands while threads start or end, as
they do while the supervision tree boots. The signal is blocked in every other thread,
so `dump_stacks_on` must run before any other thread starts: native ones too, such as
the BLAS pool numpy starts on import.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading


def dump_stacks_on(sig: signal.Signals) -> None:
    """Write every thread's stack to stderr each time `sig` arrives."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {sig})

    def wait() -> None:
        while True:
            signal.sigwait({sig})
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    threading.Thread(target=wait, name=f"barrel-{sig.name.lower()}", daemon=True).start()
