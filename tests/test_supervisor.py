"""The OTP supervisor on Pykka, observed through thread probes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pykka
import pytest

from barrel.actors.bridge import call_sync
from barrel.actors.child import Exit
from barrel.actors.registry import Registry
from barrel.actors.supervisor import (
    ChildSpec,
    ChildType,
    Restart,
    StartFailed,
    Strategy,
    Supervisor,
    SupervisorEnv,
    SupFlags,
    start_root,
    supervisor_spec,
)
from barrel.actors.timers import ManualClock
from barrel.errors import InvalidRequest, NotFound
from barrel.metrics import Metrics
from tests.probes import Probe, Worker, worker


class Tree:
    """A root supervisor under test, with its registry, clock and exit probe."""

    def __init__(
        self,
        probe: Probe,
        flags: SupFlags,
        children: Callable[[SupervisorEnv], Sequence[ChildSpec]],
        observer: Any = None,
    ) -> None:
        self.probe = probe
        self.registry = Registry()
        self.clock = ManualClock()
        kwargs = {"observer": observer} if observer is not None else {}
        self.env = SupervisorEnv(self.registry, self.clock, **kwargs)
        self.root_exits: list[Exit] = []
        self.root_exited = threading.Event()
        spec = supervisor_spec("root", flags, children(self.env), self.env)
        self.root = start_root(spec, self.registry, self._on_exit)

    def _on_exit(self, reason: Exit) -> None:
        self.root_exits.append(reason)
        self.root_exited.set()

    def ref(self, name: str) -> pykka.ActorRef[Any]:
        return self.registry.get(name)

    def proxy(self, name: str) -> Any:
        return self.ref(name).proxy()

    def sup(self) -> Any:
        return self.root.proxy()

    def crash(self, name: str) -> None:
        self.ref(name).tell("crash")


def specs(probe: Probe, *ids: str, restart: Restart = Restart.PERMANENT) -> list[ChildSpec]:
    return [ChildSpec(i, worker(probe), restart=restart) for i in ids]


def new_ref_for(tree: Tree, name: str, old: pykka.ActorRef[Any]) -> Any:
    """Wait until the registry holds a live ref for `name` other than `old`."""
    return tree.registry.wait_for(name, other_than=old, timeout=5)


@pytest.fixture
def probe() -> Probe:
    return Probe()


def test_children_start_in_order_and_stop_in_reverse(probe: Probe) -> None:
    tree = Tree(probe, SupFlags(), lambda env: specs(probe, "a", "b", "c"))
    assert probe.of("start") == [("start", "a"), ("start", "b"), ("start", "c")]
    tree.root.stop(block=True, timeout=5)
    assert probe.of("stop") == [
        ("stop", "c", "normal"),
        ("stop", "b", "normal"),
        ("stop", "a", "normal"),
    ]
    assert tree.registry.whereis("a") is None
    assert [e.kind for e in tree.root_exits] == ["normal"], "an orderly stop is a normal exit"


def test_one_for_one_restarts_only_the_failed_child(probe: Probe) -> None:
    tree = Tree(
        probe, SupFlags(Strategy.ONE_FOR_ONE, 5, 10), lambda env: specs(probe, "a", "b", "c")
    )
    a, b, c = tree.ref("a"), tree.ref("b"), tree.ref("c")
    probe.clear()
    tree.crash("b")
    b2 = new_ref_for(tree, "b", b)
    probe.wait_for(lambda evs: ("start", "b") in evs)
    assert b2 is not b
    assert b2.is_alive()
    assert tree.ref("a") is a
    assert tree.ref("c") is c
    assert probe.events == [("stop", "b", "crash"), ("start", "b")]
    assert b2.proxy().echo(7).get(timeout=5) == 7


def test_one_for_all_restarts_every_child_in_order(probe: Probe) -> None:
    tree = Tree(
        probe, SupFlags(Strategy.ONE_FOR_ALL, 5, 10), lambda env: specs(probe, "a", "b", "c")
    )
    a, b, c = tree.ref("a"), tree.ref("b"), tree.ref("c")
    probe.clear()
    tree.crash("b")
    probe.wait_count(("start", "c"), 1)
    assert probe.events == [
        ("stop", "b", "crash"),
        ("stop", "c", "normal"),
        ("stop", "a", "normal"),
        ("start", "a"),
        ("start", "b"),
        ("start", "c"),
    ]
    for name, old in [("a", a), ("b", b), ("c", c)]:
        assert new_ref_for(tree, name, old).is_alive()


def test_rest_for_one_restarts_the_failed_child_and_those_after_it(probe: Probe) -> None:
    tree = Tree(
        probe, SupFlags(Strategy.REST_FOR_ONE, 5, 10), lambda env: specs(probe, "a", "b", "c")
    )
    a = tree.ref("a")
    probe.clear()
    tree.crash("b")
    probe.wait_count(("start", "c"), 1)
    assert probe.events == [
        ("stop", "b", "crash"),
        ("stop", "c", "normal"),
        ("start", "b"),
        ("start", "c"),
    ]
    assert tree.ref("a") is a


def test_restart_types(probe: Probe) -> None:
    def children(env: SupervisorEnv) -> list[ChildSpec]:
        return [
            ChildSpec("perm", worker(probe), restart=Restart.PERMANENT),
            ChildSpec("trans", worker(probe), restart=Restart.TRANSIENT),
            ChildSpec("temp", worker(probe), restart=Restart.TEMPORARY),
        ]

    tree = Tree(probe, SupFlags(Strategy.ONE_FOR_ONE, 10, 10), children)
    probe.clear()

    # permanent: restarted even after a normal exit
    old = tree.ref("perm")
    tree.proxy("perm").quit().get(timeout=5)
    new_ref_for(tree, "perm", old)

    # transient: a normal exit is final...
    tree.proxy("trans").quit().get(timeout=5)
    probe.wait_for(lambda evs: ("stop", "trans", "normal") in evs)
    children_now = {c.name: c for c in tree.sup().which_children().get(timeout=5)}
    assert children_now["trans"].ref is None, "transient child restarted after a normal exit"
    assert tree.registry.whereis("trans") is None
    # ...but can be started again, and a crash is restarted
    trans = tree.sup().restart_child("trans").get(timeout=5)
    trans.tell("crash")
    new_ref_for(tree, "trans", trans)

    # temporary: never restarted, and forgotten
    tree.crash("temp")
    probe.wait_for(lambda evs: ("stop", "temp", "crash") in evs)
    names = [c.name for c in tree.sup().which_children().get(timeout=5)]
    assert names == ["perm", "trans"]
    assert tree.registry.whereis("temp") is None


def test_restart_intensity_is_a_sliding_window(probe: Probe) -> None:
    tree = Tree(
        probe, SupFlags(Strategy.ONE_FOR_ONE, intensity=2, period=10), lambda env: specs(probe, "a")
    )
    for _i in range(2):
        old = tree.ref("a")
        tree.crash("a")
        new_ref_for(tree, "a", old)
        tree.clock.advance(6)  # 2 restarts, 6 s apart: never more than 2 within 10 s
    old = tree.ref("a")
    tree.crash("a")
    new_ref_for(tree, "a", old)
    # restarts at t=0, 6, 12 -> the one at 0 has left the window; now crash twice quickly
    old = tree.ref("a")
    tree.crash("a")
    assert tree.root_exited.wait(5), "a third restart within the period must escalate"
    assert tree.root_exits[0].kind == "crash"
    assert "restarts" in str(tree.root_exits[0].error)
    assert not old.is_alive()
    assert tree.registry.whereis("a") is None


def test_exceeding_intensity_stops_every_child_in_reverse_and_escalates(probe: Probe) -> None:
    tree = Tree(
        probe,
        SupFlags(Strategy.ONE_FOR_ONE, intensity=0, period=5),
        lambda env: specs(probe, "a", "b", "c"),
    )
    probe.clear()
    tree.crash("b")
    assert tree.root_exited.wait(5)
    assert probe.events == [
        ("stop", "b", "crash"),
        ("stop", "c", "normal"),
        ("stop", "a", "normal"),
    ]
    assert not tree.root.is_alive()
    entries = {e.name: e for e in tree.registry.entries()}
    assert entries["root"].state == "failed"


def test_nested_supervisor_escalates_to_its_parent_which_restarts_it(probe: Probe) -> None:
    metrics = Metrics()

    def children(env: SupervisorEnv) -> list[ChildSpec]:
        inner = supervisor_spec(
            "inner", SupFlags(Strategy.ONE_FOR_ONE, 0, 5), specs(probe, "leaf"), env
        )
        return [ChildSpec("sibling", worker(probe)), inner]

    tree = Tree(probe, SupFlags(Strategy.ONE_FOR_ONE, 3, 5), children, observer=metrics)
    sibling, inner, leaf = tree.ref("sibling"), tree.ref("inner"), tree.ref("leaf")
    probe.clear()
    tree.crash("leaf")
    new_leaf = new_ref_for(tree, "leaf", leaf)
    assert new_ref_for(tree, "inner", inner).is_alive(), "the escalated supervisor is restarted"
    assert tree.ref("sibling") is sibling, "one_for_one: the sibling is untouched"
    assert new_leaf.proxy().echo("hi").get(timeout=5) == "hi"
    assert not tree.root_exited.is_set()
    assert metrics.restarts.labels(child="inner")._value.get() == 1
    assert metrics.restarts.labels(child="leaf")._value.get() == 0


def test_init_that_raises_is_a_failed_start(probe: Probe) -> None:
    probe.fail_init["c"] = 1
    with pytest.raises(StartFailed, match="c refuses to start") as info:
        Tree(probe, SupFlags(), lambda env: specs(probe, "a", "b", "c"))
    assert info.value.name == "root"
    # a and b had started: they are stopped again, in reverse order
    assert probe.events == [
        ("start", "a"),
        ("start", "b"),
        ("init_failed", "c"),
        ("stop", "b", "normal"),
        ("stop", "a", "normal"),
    ]


def test_init_that_hangs_past_start_timeout_is_a_failed_start(probe: Probe) -> None:
    gate = threading.Event()
    probe.block_init["slow"] = gate
    try:
        with pytest.raises(StartFailed, match="took over"):
            Tree(
                probe, SupFlags(), lambda env: [ChildSpec("slow", worker(probe), start_timeout=0.2)]
            )
    finally:
        gate.set()


def test_failed_restart_is_retried_by_message_until_it_starts(probe: Probe) -> None:
    tree = Tree(
        probe,
        SupFlags(Strategy.ONE_FOR_ONE, intensity=10, period=5),
        lambda env: specs(probe, "a", "b"),
    )
    old = tree.ref("a")
    probe.fail_init["a"] = 3
    tree.crash("a")
    new_ref_for(tree, "a", old)
    assert len(probe.of("init_failed")) == 3
    assert probe.of("start")[-1] == ("start", "a")
    # The supervisor kept answering between attempts: it never looped inside one message.
    assert [c.name for c in tree.sup().which_children().get(timeout=5)] == ["a", "b"]


def test_failed_restarts_count_towards_intensity(probe: Probe) -> None:
    tree = Tree(
        probe, SupFlags(Strategy.ONE_FOR_ONE, intensity=3, period=5), lambda env: specs(probe, "a")
    )
    probe.fail_init["a"] = 100
    tree.crash("a")
    assert tree.root_exited.wait(5), "a child that never restarts must escalate"
    assert len(probe.of("init_failed")) == 3


def test_ask_crash_reaches_caller_and_restarts_actor(probe: Probe) -> None:
    tree = Tree(probe, SupFlags(Strategy.ONE_FOR_ONE, 5, 10), lambda env: specs(probe, "a"))
    old = tree.ref("a")
    with pytest.raises(RuntimeError, match="boom"):
        call_sync(old, Worker.crash)
    new = new_ref_for(tree, "a", old)
    assert not old.is_alive()
    assert new.proxy().echo(1).get(timeout=5) == 1


def test_expected_error_in_ask_goes_to_caller_and_actor_lives_on(probe: Probe) -> None:
    tree = Tree(probe, SupFlags(Strategy.ONE_FOR_ONE, 5, 10), lambda env: specs(probe, "a"))
    ref = tree.ref("a")
    with pytest.raises(NotFound):
        call_sync(ref, Worker.not_found)
    assert ref.is_alive()
    assert tree.ref("a") is ref
    assert call_sync(ref, Worker.echo, 2) == 2
    assert probe.of("stop") == []


def test_simple_one_for_one_dynamic_children(probe: Probe) -> None:
    def children(env: SupervisorEnv) -> list[ChildSpec]:
        template = ChildSpec("model", worker(probe), restart=Restart.TRANSIENT)
        return [
            supervisor_spec("models", SupFlags(Strategy.SIMPLE_ONE_FOR_ONE, 5, 10), [template], env)
        ]

    tree = Tree(probe, SupFlags(), children)
    models = tree.proxy("models")
    assert models.which_children().get(timeout=5) == []
    x = models.start_child("x", "arg-x").get(timeout=5)
    models.start_child("y", "arg-y").get(timeout=5)
    assert tree.ref("x") is x
    assert x.proxy().get_args().get(timeout=5) == ("arg-x",)
    with pytest.raises(InvalidRequest):
        models.start_child("x").get(timeout=5)

    x.tell("crash")  # transient + crash: restarted with the same arguments
    x2 = new_ref_for(tree, "x", x)
    assert x2.proxy().get_args().get(timeout=5) == ("arg-x",)

    models.terminate_child("y").get(timeout=5)
    assert [c.name for c in models.which_children().get(timeout=5)] == ["x"]
    assert tree.registry.whereis("y") is None
    with pytest.raises(NotFound):
        models.terminate_child("y").get(timeout=5)

    tree.proxy("x").quit().get(timeout=5)  # transient + normal exit: forgotten
    probe.wait_for(lambda evs: ("stop", "x", "normal") in evs)
    assert models.which_children().get(timeout=5) == []


def test_start_child_failure_is_returned_and_supervisor_lives(probe: Probe) -> None:
    def children(env: SupervisorEnv) -> list[ChildSpec]:
        template = ChildSpec("model", worker(probe))
        return [
            supervisor_spec("models", SupFlags(Strategy.SIMPLE_ONE_FOR_ONE, 5, 10), [template], env)
        ]

    tree = Tree(probe, SupFlags(), children)
    probe.fail_init["bad"] = 1
    with pytest.raises(StartFailed):
        tree.proxy("models").start_child("bad").get(timeout=5)
    assert tree.proxy("models").which_children().get(timeout=5) == []
    assert tree.ref("models").is_alive()


def test_child_that_ignores_shutdown_is_abandoned_after_its_timeout(probe: Probe) -> None:
    gate = threading.Event()
    probe.block_terminate["stuck"] = gate

    def children(env: SupervisorEnv) -> list[ChildSpec]:
        return [ChildSpec("first", worker(probe)), ChildSpec("stuck", worker(probe), shutdown=0.3)]

    tree = Tree(probe, SupFlags(), children)
    try:
        tree.root.stop(block=True, timeout=5)  # would raise pykka.Timeout if stop hung
        assert ("stop", "first", "normal") in probe.events
    finally:
        gate.set()


def test_invalid_trees_are_refused_at_start(probe: Probe) -> None:
    with pytest.raises(StartFailed, match="duplicate"):
        Tree(probe, SupFlags(), lambda env: specs(probe, "a", "a"))
    with pytest.raises(StartFailed, match="exactly one"):
        Tree(probe, SupFlags(Strategy.SIMPLE_ONE_FOR_ONE), lambda env: specs(probe, "a", "b"))


def test_which_children_reports_types(probe: Probe) -> None:
    def children(env: SupervisorEnv) -> list[ChildSpec]:
        return [ChildSpec("w", worker(probe)), supervisor_spec("s", SupFlags(), [], env)]

    tree = Tree(probe, SupFlags(), children)
    info = tree.sup().which_children().get(timeout=5)
    assert [(c.name, c.type, c.running) for c in info] == [
        ("w", ChildType.WORKER, True),
        ("s", ChildType.SUPERVISOR, True),
    ]
    assert isinstance(tree.ref("s").proxy().which_children().get(timeout=5), list)
    assert Supervisor is tree.ref("s").actor_class
    assert Worker is tree.ref("w").actor_class
