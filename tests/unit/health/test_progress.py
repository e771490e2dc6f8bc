"""Busy, stuck or frozen (health/progress.py) over sampled shapes."""

import pytest

from health.progress import BUSY, FROZEN, STUCK, UNKNOWN, WINDOW, Progress, Sample, advance, fresh_gpu, gpu_use, moved, verdict


def s(t, cpu=0.0, io=0, moves=0, gpu=0.0, stopped=False):
    return Sample(t, cpu, io, moves, gpu, stopped)


@pytest.mark.parametrize(
    "before, after, what",
    [
        (s(0), s(1), []),  # a sleep, a blocked read, a deadlock: nothing
        (s(0, cpu=1.0), s(1, cpu=1.002), []),  # the heartbeat thread's few hundred microseconds a second
        (s(0, cpu=1.0), s(1, cpu=1.9), ["cpu 90%"]),  # an evaluation's forward passes
        (s(0, cpu=1.0), s(2, cpu=1.2), ["cpu 10%"]),  # a data loader's workers, counted with their parent
        (s(0, io=10), s(1, io=4096), ["io 4086 bytes"]),  # a save throttled by the disk
        (s(0, moves=3), s(1, moves=4), ["main thread moved"]),  # a polling loop in Python
        (s(0, moves=-1), s(1, moves=-1), []),  # no page (restart mode): no position known
        (s(0), s(1, gpu=35.0), ["gpu 35%"]),  # kernels on its GPU
        (s(1, cpu=1.0), s(1, cpu=2.0), []),  # no time passed: no rate
    ],
)
def test_what_moved(before, after, what):
    assert moved(before, after) == what


def fold(samples):
    state = ref = None
    for x in samples:
        state, ref = advance(state, ref, x)
    return state


def test_windows_shorter_than_a_second_are_not_compared():
    state = fold([s(0.0), s(0.3, cpu=0.3), s(0.6, cpu=0.6)])
    assert state.progress_at == 0.0  # the CPU clock ticks in 10 ms: 0.3 s windows would be noise
    state = fold([s(0.0), s(0.3, cpu=0.3), s(0.6, cpu=0.6), s(1.1, cpu=1.1)])
    assert state.progress_at == 1.1 and state.evidence == ("cpu 100%",)


@pytest.mark.parametrize(
    "samples, idle, now, want",
    [
        ([], 5.0, 5.0, (UNKNOWN, 0.0)),  # never sampled
        ([s(t, cpu=t) for t in range(10)], 9.0, 9.0, (BUSY, 0.0)),  # an evaluation: CPU all along
        ([s(t, cpu=min(t, 2)) for t in range(10)], 9.0, 9.0, (STUCK, 7.0)),  # computed 2 s, then went to sleep
        ([s(t) for t in range(10)], 4.0, 9.0, (STUCK, 4.0)),  # no progress for longer than it was idle: idle bounds it
        ([s(t, io=1000 * t) for t in range(10)], 9.0, 9.0, (BUSY, 0.0)),  # writing a checkpoint
        ([s(t, moves=t) for t in range(10)], 9.0, 9.0, (BUSY, 0.0)),  # Python that runs
        ([*(s(t, cpu=t) for t in range(5)), s(5, cpu=5, stopped=True)], 5.0, 5.0, (FROZEN, 5.0)),  # SIGSTOP: at once
        ([s(t, cpu=t) for t in range(10)], 9.0, 9.0 + 3 * WINDOW, (STUCK, 3.0)),  # no sample since: no evidence either
    ],
)
def test_verdict(samples, idle, now, want):
    assert verdict(fold(samples) if samples else None, idle, now) == want


def test_a_first_sample_is_no_evidence_either_way():
    """One look compares nothing: neither busy (a silent worker would be spared on no evidence)
    nor stuck; a stopped process is frozen from the first look."""
    assert verdict(fold([s(100.0)]), 30.0, 100.0) == (UNKNOWN, 0.0)
    assert verdict(fold([s(100.0), s(100.5, cpu=0.5)]), 30.0, 100.5) == (UNKNOWN, 0.0)
    assert verdict(fold([s(100.0, stopped=True)]), 30.0, 100.0) == (FROZEN, 30.0)
    assert verdict(Progress(s(100.0), 100.0, windows=1), 30.0, 110.0) == (STUCK, 10.0)


@pytest.mark.parametrize(
    "samples, running, device_util, want",
    [
        ([(7, 80)], [7], 90, 80.0),  # its own samples decide
        ([(7, 0)], [7], 90, 0.0),  # ... also when they say it is idle (the device's work is not its)
        ([(7, 10), (7, 60)], [7, 8], None, 60.0),  # several samples since the last look: the busiest
        ([], [7], 90, 90.0),  # no per-process samples (unsupported): the device's, when it is the one process there
        ([], [7, 8], 90, 0.0),  # ... not when another process computes on the same GPU
        ([(8, 70)], [7, 8], 90, 0.0),  # samples of another process only
        ([], [7], 0, 0.0),  # an idle device
        ([], [7], None, 0.0),  # utilization not known
        ([], [], 90, 0.0),  # not on this GPU at all
        ([], [8], 90, 0.0),  # a CUDA context alone is no evidence, and this one is not even its
    ],
)
def test_gpu_use_of_one_process(samples, running, device_util, want):
    assert gpu_use(7, samples, running, device_util) == want


@pytest.mark.parametrize(
    "look, now, want",
    [
        (None, 10.0, 0.0),  # never looked at
        ((9.0, 55.0), 10.0, 55.0),  # the last poll's
        ((0.0, 55.0), 10.0, 55.0),  # two polls of 5 s ago: still the present
        ((0.0, 55.0), 10.5, 0.0),  # older: NVML stopped answering, no evidence
    ],
)
def test_a_look_at_the_gpu_stands_for_the_present_for_two_polls(look, now, want):
    assert fresh_gpu(look, now, poll_interval=5.0) == want


def test_a_rank_whose_gpu_works_while_its_cpu_waits_is_busy():
    """A ``torch.cuda.synchronize()`` on a long kernel: no CPU, no I/O, no move of its main
    thread, its GPU at 90% all along: busy, never stuck; when the GPU goes idle, stuck."""
    state = fold([s(t, gpu=90.0) for t in range(10)])
    assert verdict(state, 9.0, 9.0) == (BUSY, 0.0)
    state = fold([*(s(t, gpu=90.0) for t in range(3)), *(s(t) for t in range(3, 12))])
    assert verdict(state, 11.0, 11.0) == (STUCK, 9.0)
