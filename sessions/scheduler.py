"""The scheduling policy: which jobs run in the next step, and how many tokens each.

`Scheduler.schedule` is the whole policy. It reads jobs (their priority, arrival, how long they
have waited, how many tokens they want, which FIFO jobs may join them) and returns a plain
`StepPlan`; it changes nothing, so it is tested without a model.

- Order: priority class (question < action < ingest < thinking < flash), then arrival.
- Aging: a job that has waited `aging_s` since it last ran is ranked one class higher per
  `aging_s` waited, so a low class is never starved by a stream of higher ones. Background work
  (flash, thinking) ages at most up to the ingest class: never above questions and actions.
  Waiting counts from the job's last step, not its submission, so a long evaluation that runs
  every step does not pile up age.
- Urgent: a flash evaluation of a question already marked stale (`flash.stale`) takes the
  budget right after questions and actions, ahead of any backlog of input however long it has
  waited, so a feed that never pauses cannot starve it (it needs few tokens per step).
- Budget: `step_tokens` per step; when a question or an action is among the candidates, the
  step is kept short (`query_step_tokens`, or what those interactive jobs need) so their
  decode steps are not slowed by a large prefill.
- Joining: an append that finishes within the step takes the appends queued right behind it in
  its FIFO into the same step, so a backlog of small appends costs few large steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .jobs import Job, Priority


@dataclass(slots=True)
class Entry:
    """One job's share of a step: `tokens` to plan (0: it finishes without a forward); `after`:
    the job it is written right behind in this step (a joining append), if any."""

    job: Job
    tokens: int
    after: Job | None = None


@dataclass(slots=True)
class StepPlan:
    entries: list[Entry] = field(default_factory=list)
    budget: int = 0

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def tokens(self) -> int:
        return sum(e.tokens for e in self.entries)


@dataclass(slots=True)
class Scheduler:
    step_tokens: int = 512
    query_step_tokens: int = 64
    aging_s: float = 2.0

    def rank(self, job: Job, now: float) -> tuple[float, int]:
        """Priority class, raised one class per `aging_s` waited, then arrival order."""
        aged = job.priority - (now - job.waiting_since) // self.aging_s
        if job.background:
            aged = max(aged, Priority.INGEST)
        return aged, job.order

    def order(self, heads: list[Job], now: float) -> list[Job]:
        """Heads in the order they take the budget: by rank, except that urgent jobs come right
        after the interactive ones (questions, actions), ahead of any backlog however aged."""
        ranked = sorted(heads, key=lambda job: self.rank(job, now))
        urgent = [job for job in ranked if job.urgent]
        if not urgent:
            return ranked
        interactive = [job for job in ranked if not job.urgent and job.priority <= Priority.ACTION]
        return interactive + urgent + [job for job in ranked if not job.urgent and job.priority > Priority.ACTION]

    def budget(self, jobs: list[Job]) -> int:
        interactive = [job.want() for job in jobs if job.priority <= Priority.ACTION]
        if not interactive:
            return self.step_tokens
        # Someone waits on each of these steps: pack only a little prefill with them.
        return min(self.step_tokens, max(self.query_step_tokens, sum(interactive)))

    def schedule(self, heads: list[Job], followers, now: float) -> StepPlan:
        """`heads`: every job that may run now; `followers(job)`: the FIFO jobs that may join
        `job` in one step. Returns the plan; nothing is changed."""
        plan = StepPlan(budget=self.budget(heads))
        left = plan.budget
        for head in self.order(heads, now):
            if left <= 0:
                break
            prev = None
            for job in [head, *followers(head)]:
                want = job.want()
                n = min(want, left)
                plan.entries.append(Entry(job, n, prev))
                left -= n
                if left <= 0 or n < want or not job.joins:
                    break
                prev = job
        return plan
