"""The scheduling policy: which jobs run in the next step, and how many tokens each.

`Scheduler.schedule` is the whole policy. It reads jobs (their priority, arrival, how long they
have waited, how many tokens they want, which FIFO jobs may join them) and returns a plain
`StepPlan`; it changes nothing, so it is tested without a model.

- Order: priority class (question < action < ingest < thinking < flash), then arrival.
- Aging: a job that has waited `aging_s` since it last ran is ranked one class higher per
  `aging_s` waited, so a low class is never starved by a stream of higher ones. Background work
  (flash, thinking) ages at most up to the ingest class: never above questions and actions.
  Waiting counts from the job's last step, or from when it reached the head of its session's
  FIFO, not from its submission: a long evaluation that runs every step does not pile up age,
  nor does input queued behind its own session's work (it was not passed over).
- Urgent: a flash evaluation of a question already marked stale (`flash.stale`) takes the
  budget right after questions and actions, ahead of any backlog of input however long it has
  waited, so a feed that never pauses cannot starve it (it needs few tokens per step).
- Fair share: within a class, jobs of the owner (API key, else client) that ran fewer tokens in
  recent steps go first, then those of the session that ran fewer, then arrival. Usage is
  counted by `charge` as each step is planned and halves every `share_half_life_s`; it is
  compared in units of `step_tokens`, so work of similar size keeps its arrival order. One
  client's backlog, however deep, cannot push another's append or question behind it.
- Budget: `step_tokens` per step; when a question or an action is among the candidates, the
  step is kept short (`query_step_tokens`, or what those interactive jobs need) so their
  decode steps are not slowed by a large prefill. With several owners asking, the owner that
  needs least sets the step, so one client's many long questions cannot slow another's decode.
  Short means by cost, too: from the steps it has seen (`StepCost`: seconds = fixed + per-token
  x tokens, fitted as they run), a question's step packs no more work than keeps it within
  `query_step_cost` (2x) of a step of a token for each question (and action) alone. On a GPU,
  where 64 tokens cost about what one does, that is `query_step_tokens`; on a CPU, where a
  token of prefill costs a sixth of a decode step, it is a few tokens, so an 8-token answer is
  not paid at prefill rates. And no
  step is planned to take over `max_step_s` (0.25 s), questions' own prefill included (it is
  chunked): a question that arrives waits for the step in progress, and a 512-token step on a
  2-core CPU takes 0.7 s.
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


def owner_of(job: Job) -> str:
    """Whose work a job is, for the fair share: its session's owner (the API key, else the
    client that created it), else the session itself."""
    return job.session.owner or job.session.id


@dataclass(slots=True)
class Usage:
    """Tokens each owner and each session ran in recent steps, halved every `half_life_s`."""

    half_life_s: float = 2.0
    tokens: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)  # -> (tokens, as of)

    def of(self, name: tuple[str, str], now: float) -> float:
        tokens, at = self.tokens.get(name, (0.0, now))
        return tokens * 0.5 ** (max(0.0, now - at) / self.half_life_s)

    def charge(self, name: tuple[str, str], tokens: int, now: float) -> None:
        self.tokens[name] = (self.of(name, now) + tokens, now)
        if len(self.tokens) > 4096:  # forget owners and closed sessions that ran nothing lately
            self.tokens = {k: (self.of(k, now), now) for k in self.tokens if self.of(k, now) >= 1.0}


@dataclass(slots=True)
class StepCost:
    """What a step costs by its tokens, fitted to the steps run: seconds = fixed + per_token x
    tokens, by least squares over the last `span` steps or so (older steps weigh less, halving
    every `span` steps), so it follows the machine (another process taking a core, the context
    growing). Unknown (`fit` is None) until `min_steps` steps of different sizes were seen."""

    span: float = 256.0
    min_steps: int = 16
    # decayed sums: weight, tokens, seconds, tokens^2, tokens x seconds
    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    seen: int = 0
    last: tuple[float, float] | None = None  # the last good fit

    def observe(self, tokens: int, seconds: float) -> None:
        keep = 0.5 ** (1.0 / self.span)
        self.w = self.w * keep + 1.0
        self.x = self.x * keep + tokens
        self.y = self.y * keep + seconds
        self.xx = self.xx * keep + tokens * tokens
        self.xy = self.xy * keep + tokens * seconds
        self.seen += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None until a fit was possible. A fit needs
        `min_steps` steps whose sizes spread (standard deviation at least a quarter of their
        mean: steps of much the same size give a slope of noise) and a positive fixed and
        per-token cost; while the recent steps give none, the last good fit stands."""
        if self.seen < self.min_steps:
            return self.last
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < max(1.0, (0.25 * mx) ** 2):
            return self.last
        per_token = (self.xy / self.w - mx * my) / var
        fixed = my - per_token * mx
        if per_token > 0 and fixed > 0:
            self.last = (fixed, per_token)
        return self.last

    def tokens_for(self, seconds: float) -> int | None:
        """The most tokens a step may hold and take at most `seconds`, or None while unknown."""
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, per_token = fitted
        return max(1, int((seconds - fixed) / per_token))

    def tokens_within(self, ratio: float, base: int = 1) -> int | None:
        """The most tokens a step may hold and cost at most `ratio` x a step of `base` tokens
        (never fewer than `base`), or None while unknown."""
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, per_token = fitted
        return max(base, int(base + (ratio - 1) * (fixed + per_token * base) / per_token))


@dataclass(slots=True)
class Scheduler:
    step_tokens: int = 512
    query_step_tokens: int = 64
    aging_s: float = 2.0
    share_half_life_s: float = 2.0
    query_step_cost: float = 2.0  # a question's step costs at most this many times a step of its own (0: off)
    max_step_s: float = 0.25  # a step takes at most about this long, by the cost model (0: off)
    usage: Usage = field(init=False)
    cost: StepCost = field(init=False)

    def __post_init__(self) -> None:
        self.usage = Usage(self.share_half_life_s)
        self.cost = StepCost()

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` took `seconds`: the cost model learns from it."""
        self.cost.observe(tokens, seconds)

    def step_budget(self) -> int:
        """The most tokens a step packs: `step_tokens`, fewer where the steps seen say a step that
        long would take over `max_step_s` (a question arriving meanwhile waits for the step in
        progress); never fewer than `query_step_tokens`."""
        within = self.cost.tokens_for(self.max_step_s) if self.max_step_s > 0 else None
        return self.step_tokens if within is None else min(self.step_tokens, max(self.query_step_tokens, within))

    def query_budget(self, asking: int = 1) -> int:
        """The most tokens a step with `asking` questions (and actions) in it packs:
        `query_step_tokens`, fewer where the steps seen say more would cost over
        `query_step_cost` x a step of a token for each of them alone (never fewer than that)."""
        within = (self.cost.tokens_within(self.query_step_cost, asking) if self.query_step_cost > 0 else None)
        return self.query_step_tokens if within is None else max(asking, min(self.query_step_tokens, within))

    def rank(self, job: Job, now: float) -> tuple[float, int, int, int]:
        """Priority class, raised one class per `aging_s` waited; then the fair share (recent
        tokens of the job's owner, then of its session, in units of `step_tokens`); then arrival."""
        aged = job.priority - (now - job.waiting_since) // self.aging_s
        if job.background:
            aged = max(aged, Priority.INGEST)
        unit = max(1, self.step_tokens)
        owner = int(self.usage.of(("owner", owner_of(job)), now) // unit)
        session = int(self.usage.of(("session", job.session.id), now) // unit)
        return aged, owner, session, job.order

    def charge(self, job: Job, tokens: int, now: float) -> None:
        """`job` runs `tokens` in the step being planned: count them against its owner and session."""
        if tokens > 0:
            self.usage.charge(("owner", owner_of(job)), tokens, now)
            self.usage.charge(("session", job.session.id), tokens, now)

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
        asking: dict[str, int] = {}  # owner -> tokens its questions and actions want now
        interactive = 0
        for job in jobs:
            if job.priority <= Priority.ACTION:
                owner = owner_of(job)
                asking[owner] = asking.get(owner, 0) + job.want()
                interactive += 1
        if not asking:
            return self.step_budget()
        # Someone waits on each of these steps: pack only a little prefill with them (each of
        # them gets its token). The owner that needs least sets the size, so another's many long
        # questions cannot slow its decode.
        return min(self.step_budget(), max(self.query_budget(interactive), min(asking.values())))

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
