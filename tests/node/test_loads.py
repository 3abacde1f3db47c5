"""A model's load as a state machine (``node/loads.py``), under Hypothesis.

Requests ask for models, leave while they wait or after their answer, loads end (served,
failed, given up: to the state machine they are alike) in any order. What must hold in
every state: a request waits only on a load under way, so something will answer it; a load
that ends answers every request still waiting on it, once, and no other; one load a name at
a time, started by the first request that finds none; a name is busy while it loads and
until each request that asked for it is done. The asyncio pool around it is tested against
stand-in coordinators in test_pool_states.py.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ringd.node.loads import Loads, Start

KEYS = ("a:latest", "b:latest", "c:latest")


class LoadMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.loads = Loads()
        self.loading: set[str] = set()  # the model's own view: loads started and not ended
        self.waiting: dict[int, str] = {}  # asked, not answered, not done
        self.answered: dict[int, str] = {}  # answered, not done
        self.starts = 0

    @rule(key=st.sampled_from(KEYS))
    def ask(self, key):
        waiter, start = self.loads.ask(key)
        assert waiter not in self.waiting and waiter not in self.answered
        if key in self.loading:
            assert start == [], f"a second load of {key} while one is under way"
        else:
            assert start == [Start(key)], f"nobody started the load of {key}"
            self.loading.add(key)
            self.starts += 1
        self.waiting[waiter] = key

    @rule(key=st.sampled_from(KEYS))
    def end(self, key):
        answered = self.loads.ended(key)
        want = sorted(w for w, k in self.waiting.items() if k == key) if key in self.loading else []
        assert answered == want, f"the end of {key}'s load answered {answered}, not its waiters {want}"
        for w in answered:
            self.answered[w] = self.waiting.pop(w)
        self.loading.discard(key)

    @rule(data=st.data())
    def leave_waiting(self, data):
        if self.waiting:
            waiter = data.draw(st.sampled_from(sorted(self.waiting)))
            self.loads.done(waiter)  # its client went before the load ended
            del self.waiting[waiter]

    @rule(data=st.data())
    def go_on(self, data):
        if self.answered:
            waiter = data.draw(st.sampled_from(sorted(self.answered)))
            self.loads.done(waiter)  # routed to the instance, or failed with the load's reason
            del self.answered[waiter]

    @rule(waiter=st.integers(-3, 200))
    def done_twice_or_never_asked(self, waiter):
        if waiter not in self.waiting and waiter not in self.answered:
            self.loads.done(waiter)  # nothing: not a waiter (any more)

    @invariant()
    def every_waiter_waits_on_a_load_under_way(self):
        for w, key in self.waiting.items():
            assert self.loads.loading(key), f"request {w} waits on {key}, which nothing loads"

    @invariant()
    def the_states_agree(self):
        for key in KEYS:
            assert self.loads.loading(key) == (key in self.loading)
            assert self.loads.waiting(key) == sum(k == key for k in self.waiting.values())
            held = key in self.waiting.values() or key in self.answered.values()
            assert self.loads.busy(key) == (key in self.loading or held), key


LoadMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_a_load_answers_every_request_waiting_on_it_once_and_none_waits_on_nothing = LoadMachine.TestCase


def test_a_request_that_left_is_not_answered_and_the_load_still_ends():
    loads = Loads()
    first, start = loads.ask("a")
    second, again = loads.ask("a")
    assert start == [Start("a")] and again == []
    loads.done(first)  # its client went
    assert loads.busy("a") and loads.waiting("a") == 1
    assert loads.ended("a") == [second]
    assert loads.busy("a") and not loads.loading("a")  # until the answered request is routed
    loads.done(second)
    assert not loads.busy("a")
    third, start = loads.ask("a")  # asked again after anything: a new load
    assert start == [Start("a")] and third not in (first, second)
