"""Try a new model file in a child process before it enters the store.

llama.cpp aborts the process on some malformed models instead of returning an error;
`barrel.engine.trial` loads the file, tokenizes and decodes one batch in a child, so an
abort there kills only the child and the create or pull fails with a clear 400. The
store remembers the digests that passed (`ModelStore.check_loadable`).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

from barrel.store.gguf_meta import InvalidGGUF

logger = logging.getLogger(__name__)

TRIAL_TIMEOUT_S = 300.0


def trial_load(
    path: Path,
    *,
    embedding: bool = False,
    mmproj: Path | None = None,
    timeout: float = TRIAL_TIMEOUT_S,
) -> None:
    """Raise InvalidGGUF (400) when the file (with its projector) cannot be loaded and
    run; the message names no server path."""
    argv = [sys.executable, "-m", "barrel.engine.trial"]
    argv += ["--embedding"] if embedding else []
    argv += ["--mmproj", str(mmproj)] if mmproj is not None else []
    try:
        done = subprocess.run(
            [*argv, str(path)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise InvalidGGUF(f"the model did not load within {timeout:.0f}s") from None
    if done.returncode == 0:
        return
    detail = done.stderr.decode("utf-8", errors="replace").strip().splitlines()
    logger.warning("trial load of %s failed (%s): %s", path, done.returncode, detail[-3:])
    if done.returncode < 0:
        why = f"llama.cpp aborted ({signal.Signals(-done.returncode).name})"
    else:
        why = "llama.cpp refused it"
    raise InvalidGGUF(f"the model file cannot be loaded: {why}")
