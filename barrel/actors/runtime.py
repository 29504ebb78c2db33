"""Boot and stop one supervision tree; the handle the HTTP layer holds.

`boot()` and `stop()` block their caller up to the tree's start/stop timeouts: the HTTP
layer runs them in a worker thread, never on the event loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pykka

from barrel.actors.child import Exit
from barrel.actors.registry import Registry
from barrel.actors.supervisor import ChildSpec, SupervisorEnv, start_root
from barrel.actors.timers import Timers

logger = logging.getLogger(__name__)


class Runtime:
    def __init__(
        self,
        build: Callable[[SupervisorEnv], ChildSpec],
        env: SupervisorEnv,
        timers: Timers,
        on_root_exit: Callable[[Exit], None] | None = None,
    ) -> None:
        self.env = env
        self.registry: Registry = env.registry
        self.timers = timers
        self._build = build
        self.on_root_exit = on_root_exit
        self._root: pykka.ActorRef[Any] | None = None
        self._root_spec: ChildSpec | None = None
        self._stopping = False
        self.booted = threading.Event()
        self.root_exit: Exit | None = None

    @property
    def root_name(self) -> str:
        return self._root_spec.id if self._root_spec else ""

    def boot(self) -> None:
        self._root_spec = self._build(self.env)
        self._root = start_root(self._root_spec, self.registry, self._root_exited)
        self.booted.set()
        logger.info("supervision tree up")

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        root, self._root = self._root, None
        if root is not None:
            try:
                root.stop(block=True, timeout=timeout)
            except pykka.Timeout:
                logger.error("supervision tree did not stop within %ss", timeout)
            except pykka.ActorDeadError:
                pass
        self.timers.stop()
        logger.info("supervision tree stopped")

    def _root_exited(self, reason: Exit) -> None:
        # Runs in the root supervisor's thread.
        self.root_exit = reason
        if not self._stopping:
            logger.critical("supervision tree root exited: %s", reason)
            if self.on_root_exit is not None:
                self.on_root_exit(reason)
