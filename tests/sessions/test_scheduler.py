"""The scheduling policy on plain jobs, without a model: `Scheduler.schedule` reads jobs and
returns a plan, and changes nothing."""

from types import SimpleNamespace

import pytest

from streamer.sessions.jobs import Job, Priority
from streamer.sessions.scheduler import Scheduler


class Plain(Job):
    """A job that wants a fixed number of tokens; `joins` as given."""

    def __init__(self, name, priority, want, order, waited=0.0, background=False, joins=False, now=1000.0,
                 owner=None):
        super().__init__(SimpleNamespace(id=name, owner=owner))
        self.name, self.priority, self._want, self.order = name, priority, want, order
        self.background, self.joins = background, joins
        self.waiting_since = now - waited

    def want(self):
        return self._want


def names(plan):
    return [(e.job.name, e.tokens, e.after.name if e.after else None) for e in plan.entries]


def schedule(heads, followers=None, **kw):
    return Scheduler(**kw).schedule(heads, followers or (lambda job: []), 1000.0)


def test_priority_then_arrival_within_the_budget():
    plan = schedule([Plain("ingest", Priority.INGEST, 300, 1), Plain("flash", Priority.FLASH, 100, 2),
                     Plain("think", Priority.THINKING, 300, 3)], step_tokens=512)
    assert names(plan) == [("ingest", 300, None), ("think", 212, None)]  # flash waits: the budget is spent
    assert plan.tokens == 512


def test_a_question_keeps_the_step_short():
    query = Plain("q", Priority.QUERY, 1, 5)
    plan = schedule([Plain("ingest", Priority.INGEST, 400, 1), query], step_tokens=512, query_step_tokens=64)
    assert plan.budget == 64 and names(plan) == [("q", 1, None), ("ingest", 63, None)]
    long_question = Plain("q", Priority.QUERY, 200, 5)  # a long question prefills in one step
    assert schedule([long_question], step_tokens=512, query_step_tokens=64).budget == 200


def test_aging_lifts_waiting_work_but_never_background_above_questions():
    s = Scheduler(aging_s=2.0)
    query = Plain("q", Priority.QUERY, 1, 9)
    ingest = Plain("i", Priority.INGEST, 10, 1, waited=4.5)
    flash = Plain("f", Priority.FLASH, 10, 2, waited=600.0, background=True)
    assert s.rank(ingest, 1000.0) < s.rank(query, 1000.0)  # two classes up: ahead of a fresh question
    assert s.rank(flash, 1000.0)[0] == Priority.INGEST  # ten minutes waited: still below questions
    plan = schedule([flash, query], aging_s=2.0)
    assert names(plan)[0][0] == "q"


def test_waiting_counts_from_the_last_step_not_from_submission():
    s = Scheduler(aging_s=2.0)
    running = Plain("f", Priority.INGEST, 10, 1, waited=0.1)
    running.submitted_at = 0.0  # submitted long ago, but it ran a moment ago
    assert s.rank(running, 1000.0)[0] == Priority.INGEST


def test_appends_join_the_append_that_finishes_in_the_step():
    head = Plain("a", Priority.INGEST, 100, 1, joins=True)
    queue = [Plain("b", Priority.INGEST, 100, 2, joins=True), Plain("c", Priority.INGEST, 400, 3, joins=True),
             Plain("d", Priority.INGEST, 10, 4, joins=True)]
    plan = schedule([head], lambda job: queue if job is head else [], step_tokens=512)
    # b joins after a; c takes what is left and stops the chain (it does not finish in this step)
    assert names(plan) == [("a", 100, None), ("b", 100, "a"), ("c", 312, "b")]


def test_a_job_that_needs_no_forward_is_planned_with_no_tokens():
    done = Plain("empty", Priority.INGEST, 0, 1)
    plan = schedule([done, Plain("x", Priority.INGEST, 5, 2)])
    assert names(plan) == [("empty", 0, None), ("x", 5, None)]


def test_scheduling_changes_nothing():
    jobs = [Plain("a", Priority.INGEST, 100, 1, joins=True), Plain("q", Priority.QUERY, 3, 2)]
    before = [(j.order, j.waiting_since, j.done, j.want()) for j in jobs]
    Scheduler().schedule(jobs, lambda job: [], 1000.0)
    assert [(j.order, j.waiting_since, j.done, j.want()) for j in jobs] == before


def test_an_urgent_stale_evaluation_goes_after_questions_but_ahead_of_any_backlog():
    query = Plain("q", Priority.QUERY, 1, 9)
    backlog = Plain("ingest", Priority.INGEST, 2000, 1, waited=60.0)  # aged far above its class
    stale = Plain("flash", Priority.INGEST, 24, 5, background=True)
    stale.urgent = True
    plan = schedule([backlog, stale, query], step_tokens=512, query_step_tokens=64)
    assert [e.job.name for e in plan.entries] == ["q", "flash", "ingest"]
    calm = Plain("flash", Priority.FLASH, 24, 5, background=True)  # not stale: waits behind the backlog
    plan = schedule([backlog, calm], step_tokens=512)
    assert names(plan) == [("ingest", 512, None)]


def test_fair_share_puts_a_light_owner_ahead_of_a_heavy_one_in_its_class():
    """Within a class the owner that ran fewer tokens lately goes first, whatever the arrival
    order; usage halves every `share_half_life_s`, so the heavy owner's turn comes back."""
    s = Scheduler(step_tokens=512, share_half_life_s=2.0)
    heavy = Plain("heavy", Priority.INGEST, 400, 1, owner="loader")
    light = Plain("light", Priority.INGEST, 400, 2, owner="bystander")
    assert [j.name for j in s.order([heavy, light], 1000.0)] == ["heavy", "light"]  # no usage: arrival
    for _ in range(8):
        s.charge(heavy, 512, 1000.0)  # the loader ran eight full steps
    assert [j.name for j in s.order([heavy, light], 1000.0)] == ["light", "heavy"]
    plan = s.schedule([heavy, light], lambda job: [], 1000.0)
    assert names(plan) == [("light", 400, None), ("heavy", 112, None)]  # work-conserving: the rest is the loader's
    assert [j.name for j in s.order([heavy, light], 1000.0 + 2.0 * 20)] == ["heavy", "light"]  # forgotten
    # a small difference (under one step of tokens) keeps the arrival order
    s2 = Scheduler(step_tokens=512)
    s2.charge(heavy, 100, 1000.0)
    assert [j.name for j in s2.order([heavy, light], 1000.0)] == ["heavy", "light"]


def test_fair_share_counts_per_session_within_an_owner_and_never_crosses_classes():
    s = Scheduler(step_tokens=512)
    busy = Plain("busy", Priority.INGEST, 400, 1, owner="k")
    quiet = Plain("quiet", Priority.INGEST, 400, 2, owner="k")
    s.charge(busy, 4096, 1000.0)  # the same owner: its busier session goes second
    assert [j.name for j in s.order([busy, quiet], 1000.0)] == ["quiet", "busy"]
    question = Plain("q", Priority.QUERY, 1, 3, owner="k")
    s.charge(question, 100_000, 1000.0)
    flash = Plain("f", Priority.FLASH, 10, 4, background=True, owner="other")
    assert s.order([flash, question], 1000.0)[0] is question  # usage orders within a class only


def test_with_several_owners_asking_the_lightest_sets_the_step():
    """A bystander decoding (1 token a step) beside another owner's many long questions: the
    step stays at `query_step_tokens`, so its decode steps are not slowed by their prefill."""
    own = [Plain(f"l{i}", Priority.QUERY, 300, i, owner="loader") for i in range(6)]
    bystander = Plain("b", Priority.QUERY, 1, 10, owner="bystander")
    assert schedule(own, step_tokens=512, query_step_tokens=64).budget == 512  # alone: as much as it needs
    s = Scheduler(step_tokens=512, query_step_tokens=64)
    for job in own:
        s.charge(job, 512, 1000.0)  # the loader's questions have been running
    plan = s.schedule([*own, bystander], lambda job: [], 1000.0)
    assert plan.budget == 64 and names(plan)[:2] == [("b", 1, None), ("l0", 63, None)]
    long_one = Plain("b", Priority.QUERY, 200, 10, owner="bystander")  # its long question prefills in one step
    plan = s.schedule([*own, long_one], lambda job: [], 1000.0)
    assert plan.budget == 200 and names(plan) == [("b", 200, None)]


def test_the_step_cost_model_reads_fixed_and_per_token_cost_from_the_steps_seen():
    from streamer.sessions.scheduler import StepCost
    cost = StepCost()
    assert cost.fit() is None and cost.tokens_within(2.0) is None
    for i in range(40):  # a CPU: 8 ms a step plus 1.4 ms a token
        n = (1, 8, 64, 512)[i % 4]
        cost.observe(n, 0.008 + 0.0014 * n)
    fixed, per_token = cost.fit()
    assert fixed == pytest.approx(0.008, rel=1e-6) and per_token == pytest.approx(0.0014, rel=1e-6)
    assert cost.tokens_within(2.0) == 7  # 8 ms + 1.4 ms x 7 = 17.8 ms <= 2 x 9.4 ms; 8 tokens: 19.2 ms
    same = StepCost()
    for _ in range(40):
        same.observe(1, 0.01)  # only one size seen: no slope to read
    assert same.fit() is None
    for i in range(4000):  # then only steps of about one size: no new fit, the last good one stands
        cost.observe(20 + i % 3, 0.03 + 0.001 * (i % 7))
    stands = cost.fit()
    assert stands is not None and stands == cost.last
    cost.observe(21, 0.05)
    assert cost.fit() == stands


def test_a_question_step_on_a_slow_per_token_machine_packs_few_tokens():
    """Where a token costs much of a decode step (a CPU), the step a question decodes in carries
    only what keeps it within query_step_cost of the question's own step; where tokens are
    nearly free (a GPU), query_step_tokens."""
    bystander = Plain("b", Priority.QUERY, 1, 10, owner="bystander")
    flash = [Plain(f"f{i}", Priority.FLASH, 1, i, owner=f"o{i}") for i in range(30)]
    cpu = Scheduler(step_tokens=512, query_step_tokens=64)
    gpu = Scheduler(step_tokens=512, query_step_tokens=64)
    off = Scheduler(step_tokens=512, query_step_tokens=64, query_step_cost=0)
    for i in range(40):
        n = (1, 8, 64, 512)[i % 4]
        cpu.observe(n, 0.008 + 0.0014 * n)
        gpu.observe(n, 0.010 + 0.00001 * n)
        off.observe(n, 0.008 + 0.0014 * n)
    assert cpu.schedule([bystander, *flash], lambda job: [], 1000.0).budget == 7
    assert names(cpu.schedule([bystander, *flash], lambda job: [], 1000.0))[0] == ("b", 1, None)
    assert gpu.schedule([bystander, *flash], lambda job: [], 1000.0).budget == 64
    assert off.schedule([bystander, *flash], lambda job: [], 1000.0).budget == 64
    assert cpu.schedule(flash, lambda job: [], 1000.0).budget == 172  # no question: max_step_s's (below)
    long_one = Plain("b", Priority.QUERY, 120, 10, owner="bystander")  # its own prefill goes in one step
    assert cpu.schedule([long_one, *flash], lambda job: [], 1000.0).budget == 120
    longer = Plain("b", Priority.QUERY, 400, 10, owner="bystander")  # ... chunked to max_step_s
    assert cpu.schedule([longer, *flash], lambda job: [], 1000.0).budget == 172
    # twenty questions decoding at once each get their token, with what keeps the step within 2x
    # of a step of their twenty tokens: 20 + (8 ms + 1.4 ms x 20) / 1.4 ms = 45
    many = [Plain(f"q{i}", Priority.QUERY, 1, 100 + i, owner=f"u{i}") for i in range(20)]
    plan = cpu.schedule([*many, *flash], lambda job: [], 1000.0)
    assert plan.budget == 45 and {e.job.name for e in plan.entries} >= {f"q{i}" for i in range(20)}


def test_no_step_is_planned_longer_than_max_step_s_by_the_cost_model():
    """A question arriving waits for the step in progress: where a 512-token step would take
    0.7 s (a 2-core CPU), steps stay within max_step_s; on a fast machine, step_tokens."""
    backlog = [Plain(f"i{i}", Priority.INGEST, 400, i, owner=f"o{i}") for i in range(4)]
    cpu = Scheduler(step_tokens=512, query_step_tokens=64, max_step_s=0.25)
    fast = Scheduler(step_tokens=512, query_step_tokens=64, max_step_s=0.25)
    off = Scheduler(step_tokens=512, query_step_tokens=64, max_step_s=0)
    assert cpu.schedule(backlog, lambda job: [], 1000.0).budget == 512  # nothing seen yet: step_tokens
    for i in range(40):
        n = (1, 8, 64, 512)[i % 4]
        cpu.observe(n, 0.008 + 0.0014 * n)
        fast.observe(n, 0.010 + 0.00001 * n)
        off.observe(n, 0.008 + 0.0014 * n)
    plan = cpu.schedule(backlog, lambda job: [], 1000.0)
    assert plan.budget == 172 and plan.tokens == 172  # (0.25 - 0.008) / 0.0014
    assert fast.schedule(backlog, lambda job: [], 1000.0).budget == 512
    assert off.schedule(backlog, lambda job: [], 1000.0).budget == 512
    slow = Scheduler(step_tokens=512, query_step_tokens=64, max_step_s=0.25)
    for i in range(40):
        n = (1, 8, 64, 512)[i % 4]
        slow.observe(n, 0.1 + 0.01 * n)  # even 64 tokens take longer: never under query_step_tokens
    assert slow.schedule(backlog, lambda job: [], 1000.0).budget == 64
