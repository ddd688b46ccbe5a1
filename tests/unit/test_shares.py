"""Proportional shares of an island among clients: stride scheduling follows the weights, idle clients neither
pay nor bank, no one starves, and the measured device time corrects the estimates (controller/shares.py)."""

from __future__ import annotations

import collections
import queue
import threading
import time

import pytest

from controller.shares import ClientGone, CostModel, ShareScheduler

pytestmark = pytest.mark.timeout(30)

EST = 0.01


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _until(condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the scheduler's waiters never settled"
        time.sleep(0.00005)


class Drive:
    """Backlogged clients on a one-slot island: each stream is a thread that calls `admit` again as soon as it is
    admitted; the test takes each ticket once every stream waits again, and finishes it. With one slot only one
    ticket is ever in flight, so the admission order (`order`) is the scheduler's choice alone."""

    def __init__(self, sched: ShareScheduler, device=lambda ticket: ticket.estimate_s):
        self.sched, self.device = sched, device
        self.tickets: queue.Queue = queue.Queue()
        self.threads: list[threading.Thread] = []
        self.order: list[str] = []
        self.errors: list[BaseException] = []
        sched.add_client("hold", 1)                        # in flight until run(): every stream starts waiting
        self._hold = sched.admit("hold", 0.0)

    def _stream(self, client: str, estimate_s: float):
        try:
            while True:
                self.tickets.put(self.sched.admit(client, estimate_s))
        except ClientGone:
            pass
        except BaseException as error:                     # pragma: no cover - reported by stop()
            self.errors.append(error)

    def _settled(self) -> bool:
        return sum(self.sched.waiting.values()) == len(self.threads)

    def start(self, client: str, estimate_s: float = EST, streams: int = 2):
        for _ in range(streams):
            thread = threading.Thread(target=self._stream, args=(client, estimate_s), daemon=True)
            thread.start()
            self.threads.append(thread)
            _until(self._settled)

    def take(self):
        if self._hold is not None:
            self.sched.remove_client("hold")
            self._hold = None
        ticket = self.tickets.get(timeout=10)
        _until(self._settled)
        return ticket

    def finish(self, ticket):
        self.sched.finished(ticket, self.device(ticket))
        self.order.append(ticket.client)

    def run(self, admissions: int) -> collections.Counter:
        start = len(self.order)
        for _ in range(admissions):
            self.finish(self.take())
        return collections.Counter(self.order[start:])

    def stop(self):
        for client in {c for c in self.sched.waiting if c != "hold"}:
            self.sched.remove_client(client)
        for thread in self.threads:
            thread.join(5)
        assert not self.errors


def _scheduler(weights: dict[str, float], **kwargs) -> ShareScheduler:
    sched = ShareScheduler("tpu-0", slots=1, **kwargs)
    for client, weight in weights.items():
        sched.add_client(client, weight)
    return sched


def test_admissions_follow_weights_1_2_4_8():
    weights = {"w1": 1, "w2": 2, "w4": 4, "w8": 8}
    drive = Drive(_scheduler(weights))
    for client in weights:
        drive.start(client, streams=3)
    counts = drive.run(150)
    drive.stop()
    for client, weight in weights.items():
        assert abs(counts[client] - 150 * weight / 15) <= 2, counts


def test_equal_weights_get_equal_admissions():
    weights = dict.fromkeys("abcd", 1)
    drive = Drive(_scheduler(weights))
    for client in weights:
        drive.start(client)
    counts = drive.run(100)
    drive.stop()
    assert all(abs(counts[c] - 25) <= 1 for c in weights), counts


def test_a_client_back_from_idle_gets_no_burst():
    drive = Drive(_scheduler({"busy": 1, "idler": 1}))
    drive.start("busy")
    assert drive.run(50) == {"busy": 50}                  # "idler" idle all along
    ticket = drive.take()
    drive.start("idler")                                   # comes back while "busy" is backlogged
    drive.finish(ticket)
    counts = drive.run(20)
    drive.stop()
    assert 9 <= counts["idler"] <= 11, counts


def test_idle_time_is_not_banked_when_the_whole_island_was_idle():
    """Deviation from the first spec: with no one backlogged a returning client is lifted to the island's last
    backlogged pass, not left at its own, or a client idle while others ran would burst once all were idle."""
    sched = _scheduler({"early": 1, "late": 1})
    for _ in range(50):                                    # "late" idle meanwhile
        sched.finished(sched.admit("early", EST), EST)
    sched.finished(sched.admit("late", EST), EST)          # the island is idle when "late" returns
    drive = Drive(sched)
    drive.start("early")
    drive.start("late")
    counts = drive.run(20)
    drive.stop()
    assert counts["late"] <= 11, counts


def test_a_light_client_is_not_starved():
    weights = {"light": 1, "heavy-a": 1000, "heavy-b": 1000}
    # Between two admissions of "light" (its pass advances EST/1) a heavy client can be admitted only while its
    # pass (advancing EST/1000 each) has not passed light's: at most 1000/1 + 1 times each.
    bound = sum(w / weights["light"] + 1 for c, w in weights.items() if c != "light") + 1
    drive = Drive(_scheduler(weights))
    for client in weights:
        drive.start(client, streams=1)
    drive.finish(drive.take())
    while drive.order.count("light") < 2:
        assert len(drive.order) < 2 * bound, f"light starved: {collections.Counter(drive.order)}"
        drive.finish(drive.take())
    drive.stop()
    at = [i for i, c in enumerate(drive.order) if c == "light"]
    assert at[0] < bound and at[1] - at[0] <= bound, (at, bound)


def test_weights_must_be_positive_and_clients_known():
    sched = _scheduler({"a": 1})
    for bad in (0, -2.5, float("nan")):
        with pytest.raises(ValueError, match=r"client 'b': weight: expected a finite number in \[1e-06, 1e\+06\], "
                                             r"got " + str(bad).replace(".", r"\.")):
            sched.add_client("b", bad)
    with pytest.raises(ValueError, match=r"client 'a'.*got -1"):
        sched.set_weight("a", -1)
    with pytest.raises(ValueError, match=r"unknown client 'zz'.*known clients: \['a'\]"):
        sched.set_weight("zz", 2)
    with pytest.raises(ValueError, match=r"unknown client 'zz'"):
        sched.admit("zz", EST)
    sched.add_client("a", 3)                               # re-adding sets the weight
    assert "a       3 " in sched.describe()


def test_removing_a_client_wakes_its_waiters_and_returns_its_slots():
    sched = ShareScheduler("tpu-0", slots=2)
    sched.add_client("a", 1)
    sched.add_client("b", 1)
    running = sched.admit("a", EST, slots=2)
    outcome = {}

    def wait(client):
        try:
            outcome[client] = sched.admit(client, EST)
        except ClientGone as gone:
            outcome[client] = gone

    threads = [threading.Thread(target=wait, args=(c,), daemon=True) for c in ("a", "b")]
    for thread in threads:
        thread.start()
    _until(lambda: sched.waiting == {"a": 1, "b": 1})
    sched.remove_client("a")
    for thread in threads:
        thread.join(5)
    assert isinstance(outcome["a"], ClientGone) and "'a' was removed from island 'tpu-0'" in str(outcome["a"])
    assert outcome["b"].client == "b" and sched.in_flight == 1
    sched.finished(running, EST)                           # void: its slots were returned already
    assert sched.in_flight == 1 and sched.waiting == {"b": 0}


def test_a_clients_calls_are_admitted_in_order():
    """Only a client's oldest waiter competes: a later, narrower call of the same client does not slip past it."""
    sched = ShareScheduler("tpu-0", slots=2)
    sched.add_client("a", 1)
    sched.add_client("b", 1)
    running = sched.admit("a", EST)
    wide = []
    thread = threading.Thread(target=lambda: wide.append(sched.admit("b", EST, slots=2)), daemon=True)
    thread.start()
    _until(lambda: sched.waiting["b"] == 1)
    with pytest.raises(TimeoutError):
        sched.admit("b", EST, timeout_s=0.05)              # one slot is free, but b's first call needs two
    sched.finished(running, EST)
    thread.join(5)
    assert wide[0].slots == 2 and sched.in_flight == 2


def test_a_program_wider_than_the_island_runs_alone():
    sched = _scheduler({"a": 1, "b": 1})
    wide = sched.admit("a", EST, slots=5, timeout_s=1)
    assert sched.in_flight == 5
    with pytest.raises(TimeoutError):
        sched.admit("b", EST, timeout_s=0.05)              # nothing else while it runs
    sched.finished(wide, EST)
    sched.finished(sched.admit("b", EST, timeout_s=1), EST)
    assert sched.in_flight == 0


def test_a_timeout_names_the_client_and_the_island():
    sched = _scheduler({"a": 1, "b": 1})
    sched.admit("a", EST)
    with pytest.raises(TimeoutError, match=r"client 'b' waited 0\.05 s for 1 slot\(s\) on island 'tpu-0' and was not "
                                           r"admitted: 1 call\(s\) ahead of it \(1 of 1 slots in flight: \{'a': 1\}"):
        sched.admit("b", EST, timeout_s=0.05)
    assert sched.waiting == {"a": 0, "b": 0}


def test_measured_time_corrects_the_estimates():
    drive = Drive(_scheduler({"slow": 1, "honest": 1}),
                  device=lambda t: 2 * t.estimate_s if t.client == "slow" else t.estimate_s)
    drive.start("slow")
    drive.start("honest")
    counts = drive.run(300)
    drive.stop()
    assert abs(counts["slow"] - counts["honest"] / 2) <= 0.1 * counts["honest"] / 2, counts


def test_describe_is_a_table_by_name():
    clock = FakeClock()
    sched = ShareScheduler("tpu-0", slots=1, clock=clock)
    sched.add_client("beta", 2)
    sched.add_client("alpha", 1)
    sched.add_client("gamma", 0.5)
    sched.finished(sched.admit("alpha", 0.004), 0.003)    # pass 0.004, corrected to 0.003
    sched.finished(sched.admit("beta", 0.01), 0.009)      # lifted to 0.003 - 0.002/2, +0.01/2, -0.001/2
    sched.admit("beta", 0.002)                            # in flight: +0.001
    waiter = threading.Thread(target=lambda: pytest.raises(ClientGone, sched.admit, "gamma", 0.001), daemon=True)
    waiter.start()
    _until(lambda: sched.waiting["gamma"] == 1)
    assert sched.describe() == (
        "island 'tpu-0': 1 of 1 slots in flight\n"
        "client  weight  pass    waiting  in flight  share 60s\n"
        "alpha   1       0.003   0        0          25.0%\n"
        "beta    2       0.0075  0        1          75.0%\n"
        "gamma   0.5     0.0035  1        0          0.0%")
    sched.remove_client("gamma")
    waiter.join(5)


def test_shares_cover_only_the_window():
    clock = FakeClock(0.0)
    sched = _scheduler({"a": 1, "b": 1, "c": 1}, clock=clock)
    assert sched.shares() == {"a": 0.0, "b": 0.0, "c": 0.0}
    sched.finished(sched.admit("a", 1.0), 1.0)             # at t=0: outside a 60 s window at t=110
    clock.now = 100.0
    sched.finished(sched.admit("b", 1.0), 1.0)
    sched.finished(sched.admit("a", 3.0), 3.0)
    clock.now = 110.0
    assert sched.shares(60.0) == {"a": 0.75, "b": 0.25, "c": 0.0}
    assert sched.shares(200.0) == {"a": 0.8, "b": 0.2, "c": 0.0}
    assert sched.shares(5.0) == {"a": 0.0, "b": 0.0, "c": 0.0}


def test_cost_model_keeps_a_moving_average():
    model = CostModel(alpha=0.5)
    assert model.estimate(("f", 1)) == 0.001 and model.estimate("g", default_s=0.5) == 0.5
    model.observe(("f", 1), 0.2)
    model.observe(("f", 1), 0.1)
    assert model.estimate(("f", 1)) == pytest.approx(0.15)
    with pytest.raises(ValueError, match="alpha"):
        CostModel(alpha=0)


def test_a_client_that_reconnects_does_not_jump_ahead_of_a_busy_one():
    """"greedy" runs calls 10 times its estimate; right after one it leaves and comes back under its name (a new
    session). It resumes the pass it left with, ~9 estimates past "busy"'s, so "busy" goes next, several times; a
    fresh pass (the old behaviour) put it at the head of the queue (after the call of busy's already admitted)."""
    drive = Drive(_scheduler({"busy": 1, "greedy": 1}),
                  device=lambda t: 10 * t.estimate_s if t.client == "greedy" else t.estimate_s)
    drive.start("busy")
    drive.start("greedy")
    drive.run(30)
    while drive.order[-1] != "greedy":                     # stop right after one of greedy's calls
        drive.finish(drive.take())
    drive.sched.remove_client("greedy")                    # its connection is gone: its waiters end
    for thread in drive.threads:
        thread.join(0.2)
    drive.threads = [thread for thread in drive.threads if thread.is_alive()]
    drive.sched.add_client("greedy", 1)                    # and it connects again
    drive.start("greedy")
    counts = drive.run(6)
    drive.stop()
    assert counts == {"busy": 6}, counts                   # the old code: greedy among them


def test_passes_of_clients_that_left_are_remembered_within_a_bound(monkeypatch):
    import controller.shares as shares

    monkeypatch.setattr(shares, "REMEMBERED_CLIENTS", 3)
    sched = ShareScheduler("tpu-0", slots=1)
    for number in range(5):
        client = f"c{number}"
        sched.add_client(client, 1)
        sched.finished(sched.admit(client, EST), 1.0 + number)
        sched.remove_client(client)
    for number in range(5):
        sched.add_client(f"c{number}", 1)
    passes = {row.split()[0]: float(row.split()[2]) for row in sched.describe().splitlines()[2:]}
    assert passes["c0"] == passes["c1"] == 0.0             # forgotten: the oldest to leave past the bound
    assert all(passes[f"c{n}"] >= 1.0 + n for n in (2, 3, 4)), passes


def test_a_client_whose_calls_never_end_gives_its_slots_back_after_the_hold_and_pays_for_them():
    """Issue 46 (found by bench/fuzz_service.py): bob's calls on an array he never puts never end; they held all 16
    slots of the island for good and alice was never admitted again."""
    clock = FakeClock()
    sched = ShareScheduler("0", slots=4, clock=clock, hold_s=10.0)
    sched.add_client("alice", 1)
    sched.add_client("bob", 1)
    stuck = [sched.admit("bob", EST) for _ in range(4)]   # alone: he may fill the window
    admitted = []
    waiter = threading.Thread(target=lambda: admitted.append(sched.admit("alice", EST)))
    waiter.start()
    _until(lambda: sched.waiting["alice"] == 1)
    assert not admitted                                    # the window is full of bob's
    clock.now += 10.5
    waiter.join(5)                                         # waiters look at the hold at least once a second
    assert admitted and admitted[0].client == "alice" and sched.expired == 4
    for ticket in stuck:                                   # their Dones, if they ever come, change nothing more
        sched.finished(ticket, EST)
    assert sched.in_flight == 1


def test_while_another_client_competes_no_client_holds_more_than_half_the_window():
    clock = FakeClock()
    sched = ShareScheduler("0", slots=4, clock=clock)
    sched.add_client("alice", 1)
    sched.add_client("bob", 1)
    first = sched.admit("bob", EST)
    held_by_alice = sched.admit("alice", EST)             # alice holds a slot: bob now competes with her
    second = sched.admit("bob", EST)                       # bob: 2 of 4 slots, half the window
    got = []
    third = threading.Thread(target=lambda: got.append(sched.admit("bob", EST)))
    third.start()
    time.sleep(0.3)
    assert not got and sched.in_flight == 3                # a slot is free, but not for bob
    sched.finished(held_by_alice, EST)                     # alice done: bob alone may fill the window again
    third.join(5)
    assert got and sched.in_flight == 3
    for ticket in (first, second, got[0]):
        sched.finished(ticket, EST)
