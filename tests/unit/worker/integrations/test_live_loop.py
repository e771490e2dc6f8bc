"""tm_launch.worker.integrations.live_loop: the framework step driver's rules, on a scripted job (the real one is
exercised end to end with each framework in test_frameworks.py)."""

import pytest

from tm_launch.worker.integrations.live_loop import LiveLoop, live_job


class ScriptedJob:
    """``steps()`` yields the step until it commits; ``commit()`` answers from a script;
    ``generation`` changes when the script says so (a failure repaired inside ``steps()``)."""

    def __init__(self, commits, generations):
        self.commits, self.generations = list(commits), list(generations)
        self.generation, self.step, self.closed, self.ended = 0, None, False, None
        self.step_ok = True
        self.abandoned = 0  # abandon_step() calls

    def abandon_step(self):
        self.abandoned += 1

    def steps(self, total, start=0):
        self.step = start
        try:
            while True:
                self.generation = self.generations.pop(0)
                yield self.step
                if self.last:
                    self.step += 1
        except GeneratorExit:
            self.closed = True

    def end_loop(self):
        self.ended = not self.closed  # said before the close: the worker counts as finished

    def commit(self):
        self.last = self.commits.pop(0)
        return self.last


@pytest.mark.parametrize(
    "commits, generations, attempts, renewals",
    [
        ([True], [0], 1, 0),  # one attempt, committed
        ([False, True], [0, 1], 2, 1),  # interrupted: repaired in generation 1, run again, a new DDP first
        ([False, False, True], [0, 1, 2], 3, 2),  # interrupted twice
        ([False, True], [0, 0], 2, 0),  # not committed, same generation (a vote that failed): no renewal
    ],
)
def test_a_step_runs_until_it_commits(commits, generations, attempts, renewals):
    job = ScriptedJob(commits, generations)
    loop, calls, renewed, new_steps = LiveLoop(job), [], [], []
    result = loop.run(5, lambda: calls.append(1) or len(calls), on_new_generation=lambda: renewed.append(1), on_new_step=new_steps.append)
    assert result == attempts == len(calls)  # the committed attempt's result
    assert len(renewed) == renewals and new_steps == [5]  # snapshot once per step, not per attempt
    loop.close()
    assert job.closed and job.ended


def test_the_framework_and_the_job_must_agree_on_the_step():
    job = ScriptedJob([True, True], [0, 0])
    loop = LiveLoop(job)
    loop.run(3, lambda: None)
    with pytest.raises(RuntimeError, match="one optimizer step per batch"):
        loop.run(3, lambda: None)  # the framework did not count the committed step (e.g. accumulation)


class SequenceJob:
    """``steps()`` yields a scripted sequence of steps (a return to an earlier one, a jump); every
    attempt commits."""

    def __init__(self, sequence):
        self.sequence, self.generation = list(sequence), 0

    def steps(self, total, start=0):
        yield from self.sequence

    def commit(self):
        return True


@pytest.mark.parametrize(
    "framework_step, sequence, ran",
    [
        (5, [5], [5]),
        (5, [4, 5], [4, 5]),  # survivors returned to step 4 (a snapshot still on its way): 4, then 5 again
        (2, [7], [7]),  # a spare's loop after its warm-up steps joins the job at step 7
    ],
)
def test_a_framework_that_follows_the_job_runs_the_jobs_steps(framework_step, sequence, ran):
    loop, seen, running = LiveLoop(SequenceJob(sequence)), [], []
    loop.run(framework_step, lambda: running.append(loop.running), at_step=seen.append)
    assert seen == ran and all(running) and not loop.running


def test_a_joiner_returns_to_its_framework_in_the_step_the_others_are_in():
    """The job returned to step 3 (a snapshot still on its way) while the survivors' loops were
    in step 4; a spare that warmed up to step 2 joins: it runs 3 and 4 before its loop goes on,
    as the survivors do, so whatever the framework does between steps happens at step 4 for all."""
    job = SequenceJob([3, 4])
    loop, seen = LiveLoop(job), []

    def body():
        if seen == [3]:
            loop.join_at(4)  # as the state received on entering, inside the first next(), does
        return len(seen)

    loop.run(2, body, at_step=seen.append)
    assert seen == [3, 4] and loop.started == 4
    survivor = LiveLoop(SequenceJob([3, 4]))
    survivor.started = 4
    survivor.join_at(3)  # its own snapshot of step 3: no news
    assert survivor.started == 4


def test_a_process_group_started_before_init_is_one_clear_error(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("TM_AGENT_STORE", "127.0.0.1:1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="call tm_launch.init\\(\\) first"):
            live_job()
    finally:
        dist.destroy_process_group()


def test_outside_tm_launch_there_is_no_live_job(monkeypatch):
    monkeypatch.delenv("TM_AGENT_STORE", raising=False)
    assert live_job() is None


def test_metrics_are_published_only_when_final():
    """``final_only``: a framework's metrics logger is called in a committed step whose
    collectives all succeeded; never in a spare's warm-up nor in an interrupted step."""
    import types

    from tm_launch.worker.integrations.live_loop import final_only

    published = []
    job = types.SimpleNamespace(in_sandbox=False, step_ok=True)
    log = final_only(job, lambda step, **values: published.append((step, values)))
    log(1, loss=0.5)
    job.step_ok = False  # a collective of the step failed: its numbers are this rank's garbage
    log(2, loss=6.4, grad_norm=5.7e17)
    job.step_ok, job.in_sandbox = True, True  # a spare's warm-up step
    log(1, loss=0.7)
    job.in_sandbox = False
    log(2, loss=0.4)
    assert published == [(1, {"loss": 0.5}), (2, {"loss": 0.4})]


def test_what_the_framework_raises_in_an_interrupted_step_runs_the_step_again():
    """torchtitan stops on a loss that is not finite, which is what a failed all-reduce leaves:
    in an interrupted step (``step_ok`` false) that is no failure of the training."""
    job = ScriptedJob([False, True], [0, 1])
    loop, attempts = LiveLoop(job), []

    def body():
        attempts.append(1)
        if len(attempts) == 1:
            job.step_ok = False  # the collective failed
            raise RuntimeError("Loss is not finite (global_avg_loss=nan) at step 6. Stopping training.")
        job.step_ok = True
        return "done"

    assert loop.run(5, body) == "done" and len(attempts) == 2
    assert job.abandoned == 1  # the rest of the attempt's collectives never ran: its subgroups are closed at the boundary


def test_what_the_framework_raises_in_a_healthy_step_is_raised():
    job = ScriptedJob([True], [0])
    with pytest.raises(ValueError, match="a real bug"):
        LiveLoop(job).run(5, lambda: (_ for _ in ()).throw(ValueError("a real bug")))
