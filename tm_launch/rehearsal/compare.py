"""Which tensors of a rank's state differ from the fault-free run, and the likely cause.

Pure: it reads two dumps (``tm_launch.worker.rehearsal_dump``: flat ``entries`` and their
``roles``) and decides. Why causes are read off roles: a recovery that went wrong leaves its
mark on what it could not see or restore, while parameters and optimizer state are what every
cause spoils in the end. So parameters that differ name no cause by themselves; a buffer, an
RNG, a data position or a plain attribute that differs does. When only parameters (and the
optimizer state that follows them) differ, every registered object came back right and
training still went elsewhere: something the script never registered steered it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Root causes, most specific first: (title, suggestion).
CAUSES: dict[str, tuple[str, str]] = {
    "steps": (
        "the number of steps applied (an optimizer's or scheduler's step count)",
        "a step ran twice or not at all on this rank: guard effects of your own with `if job.commit():` and "
        "keep one optimizer step per job.steps() step; if the script already does, report it with this output",
    ),
    "buffer": (
        "a module buffer (e.g. BatchNorm running statistics, a counter changed in the forward)",
        "make the buffer identical on every rank (nn.SyncBatchNorm.convert_sync_batchnorm(model), or "
        "broadcast it), or keep per-rank statistics in an object registered with job.register(per_rank=True, ...)",
    ),
    "rng": (
        "the random number generators (dropout, random augmentation)",
        "register them: job.register(per_rank=True, rng=tm_launch.RNGState()) after seeding each rank",
    ),
    "data": (
        "the data position (a sampler's or loader's state)",
        "a loader the loop iterates itself is exact with a DistributedSampler or SequentialSampler (the log's "
        "`tm-launch: warning:` line names one it cannot reposition); else hand it over (batches = job.data(loader)), "
        "register the sampler or loader with job.register(per_rank=True, data=...) (it needs state_dict()/"
        "load_state_dict()), or make each step's batch a function of the step",
    ),
    "loop": (
        "a variable of the loop that runs job.steps() (a counter, a best loss, a tokens-seen count) was not carried exactly",
        "change it before the step's first optimizer step, or derive it from the step: a variable changed after the step's "
        "commit is carried to a joiner at its value from the vote (the log's `tm-launch: warning:` line names it); keep it a "
        "number, string or small tensor in the frame that iterates job.steps() (a closure's cell or an object without "
        "state_dict() is not found)",
    ),
    "effects": (
        "a step with several effects (two optimizers' steps, an update after the optimizer step): the fault came after "
        "the first was applied, and the rest of the step was not applied exactly once on every rank",
        "this is the live runtime's to make exact (issue 57: a step as one transaction over all its effects); meanwhile "
        "take one optimizer step per job.steps() step, or report it with this output",
    ),
    "file": (
        "a file the script wrote in its working directory (a checkpoint, an output, a log) holds what the recovery did not carry",
        "save only state registered with job.register (or derived from the step), and write a step's numbers only once they are "
        "final (`if job.commit():`, or `job.step_ok` after the step's collectives): a step that runs again writes twice",
    ),
    "unregistered": (
        "state the script keeps outside job.register (a tensor in a plain attribute, a counter, a cache)",
        "give it state_dict()/load_state_dict() and register it (per_rank=True if each rank holds its own), or derive it from the step",
    ),
}
ORDER = list(CAUSES)

ROLE_CAUSE = {
    "buffer": "buffer",
    "rng": "rng",
    "rng-os": "rng",
    "global-rng": "rng",
    "data": "data",
    "attr": "unregistered",
    "loop": "loop",
    "file": "file",
}
FILES = "~file"  # the key prefix of the working directory's files: "~file/<path>" (bytes), "~file/<path>:<key>" (a tensor in it)
# Seeded from the OS unless the script seeds them (Python's and numpy's generators): they may
# differ between two fault-free runs, so only a control run can say whether they count.
MAYBE_UNSEEDED = "rng-os"
STEP_COUNTERS = ("step", "last_epoch", "_step_count")
# A progress tracker's attempt counts. Lightning's loops (``lightning.pytorch.loops.progress``)
# count every attempt at a batch or an optimizer step in ``ready`` and ``started``, and the work
# done in ``processed`` and ``completed``; after a restart, ``reset_on_restart`` rolls the
# ``current`` attempt counts back to ``completed`` and keeps the ``total`` ones, by design: they
# count the attempts a restart interrupted too. A live recovery runs the interrupted step again
# on the rank that takes over, so its ``total`` attempt counts may be higher than the fault-free
# run's. Such a count is the attempt, not state: it is reported apart and fails no verdict, only
# when it is a plain integer, not lower than the fault-free run's, and the same tracker's
# ``completed`` count is equal in both runs.
ATTEMPT_COUNTS = ("ready", "started")
# Wall-clock measurements a framework logs with its metrics (Hugging Face's ``speed_metrics``:
# ``train_runtime``, ``train_samples_per_second``, ``train_steps_per_second`` in its
# ``TrainerState.log_history``): they differ between any two runs, faults or not. A float under
# a key ending so is reported apart and fails no verdict; the logged losses beside it are compared.
WALL_CLOCK = ("_runtime", "_per_second")


@dataclass(frozen=True)
class Difference:
    key: str  # the dump's flat key: "<object>/<state_dict key>", "~rng/torch", "~attr/<module>.<path>", "~loop/<variable>", "~file/<path>[:<key>]"
    role: str  # param, buffer, optim, sched, rng, data, other, attr, global-rng, file, loop
    detail: str  # "max |diff| 0.0123", "shape (2,) -> (3,)", "3 -> 4", "only in the fault-free run"

    @property
    def obj(self) -> str:
        """The object the key belongs to, as a user knows it."""
        head, _, rest = self.key.partition("/")
        if head == FILES:
            return f"file {rest.partition(':')[0]}"
        names = {
            "~rng": "global RNG (not registered)",
            "~attr": "plain attributes (not registered)",
            "~loop": "the loop's variables",
            "~data": "the loop's data loaders",
        }
        return names.get(head, head)

    @property
    def tensor(self) -> str:
        head, _, rest = self.key.partition("/")
        if head == FILES:
            return rest.partition(":")[2] or "(its bytes)"
        return rest


@dataclass(frozen=True)
class FileBytes:
    """A file that is not a torch checkpoint, compared byte for byte: its size, a digest, and its
    bytes when small enough to say where two copies first differ."""

    size: int
    digest: str
    content: bytes | None = None


@dataclass
class RankVerdict:
    rank: int | None  # None: the files the job wrote in its working directory
    differences: list[Difference] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)
    missing: str | None = None  # why there is nothing to compare (no dump)
    attempts: list[Difference] = field(default_factory=list)  # attempt counts a re-run step raised (``is_attempt_count``)
    timings: list[Difference] = field(default_factory=list)  # wall-clock measurements (``is_wall_clock``)

    @property
    def equal(self) -> bool:
        return self.missing is None and not self.differences

    @property
    def title(self) -> str:
        return "files in the working directory" if self.rank is None else f"rank {self.rank}"


def describe(a, b) -> str | None:
    """None when ``a`` and ``b`` are bitwise equal, else what differs (tensors: the largest
    absolute difference; NaN equals NaN at the same place, as a bitwise comparison has it)."""
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype:
            return f"dtype {a.dtype} -> {b.dtype}"
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} -> {tuple(b.shape)}"
        if torch.equal(a, b) or _same_bits(a, b):
            return None
        if a.is_floating_point() or a.is_complex():
            d = (a.double() - b.double()).abs()
            return f"max |diff| {d.max().item():.3g}"
        return f"{int((a != b).sum())} of {a.numel()} elements"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return f"{type(a).__name__} -> {type(b).__name__}"
    if isinstance(a, FileBytes) and isinstance(b, FileBytes):
        return _bytes_differ(a, b)
    return None if a == b else f"{a!r} -> {b!r}"[:120]


def _bytes_differ(a: FileBytes, b: FileBytes) -> str | None:
    if a.size == b.size and a.digest == b.digest:
        return None
    sizes = f"{a.size} -> {b.size} bytes" if a.size != b.size else f"{a.size} bytes"
    if a.content is None or b.content is None:
        return f"{sizes}, contents differ"
    at = next((i for i, (x, y) in enumerate(zip(a.content, b.content)) if x != y), min(a.size, b.size))
    line = a.content[:at].count(b"\n") + 1
    return f"{sizes}, first difference at byte {at} (line {line})"


def _same_bits(a, b) -> bool:
    if a.numel() == 0:
        return True
    try:
        return bool(a.contiguous().view(-1).view(_int_of(a)).equal(b.contiguous().view(-1).view(_int_of(b))))
    except (RuntimeError, TypeError):
        return False


def _int_of(t):
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size(), torch.uint8)


def differences(ref: dict, got: dict, unstable: frozenset = frozenset()) -> list[Difference]:
    """Every key of two dumps' ``entries`` whose value differs (keys in ``unstable``, which
    differ without any fault, left out)."""
    out = []
    r_entries, g_entries = ref["entries"], got["entries"]
    roles = {**got.get("roles", {}), **ref.get("roles", {})}
    for key in sorted(set(r_entries) | set(g_entries)):
        if key in unstable:
            continue
        if key not in g_entries:
            detail = "only in the fault-free run"
        elif key not in r_entries:
            detail = "only in the run with the fault"
        else:
            detail = describe(r_entries[key], g_entries[key])
        if detail is not None:
            out.append(Difference(key, roles.get(key, "other"), detail))
    return out


def is_attempt_count(key: str, ref_entries: dict, got_entries: dict) -> bool:
    """Whether ``key`` is a progress tracker's attempt count that differs as an attempt count
    may (``ATTEMPT_COUNTS``): an int not lower than the fault-free run's, beside an equal
    ``completed`` count of the same tracker."""
    head, _, leaf = key.rpartition(".")
    if leaf not in ATTEMPT_COUNTS or not head:
        return False
    ref, got = ref_entries.get(key), got_entries.get(key)
    done = f"{head}.completed"
    ref_done, got_done = ref_entries.get(done), got_entries.get(done)
    ints = all(type(v) is int for v in (ref, got, ref_done, got_done))
    return ints and got >= ref and ref_done == got_done


def is_wall_clock(key: str, ref_entries: dict, got_entries: dict) -> bool:
    """Whether ``key`` is a wall-clock measurement a framework logged (``WALL_CLOCK``): a float
    in both runs under a key ending in one of those names."""
    leaf = key.rsplit(".", 1)[-1].rsplit("/", 1)[-1]
    return leaf.endswith(WALL_CLOCK) and type(ref_entries.get(key)) is float and type(got_entries.get(key)) is float


def cause_of(d: Difference) -> str | None:
    """The root cause one difference names by itself; None for a consequence (a parameter,
    the optimizer state that follows it, another object's state)."""
    if d.role in ROLE_CAUSE:
        return ROLE_CAUSE[d.role]
    leaf = d.key.rsplit(".", 1)[-1].rsplit("/", 1)[-1]
    if d.role in ("optim", "sched") and leaf in STEP_COUNTERS:
        return "steps"
    if d.detail.startswith("only in"):
        return "unregistered"  # registered in one run only
    return None


# What the fault-free run says of a step's effects (``effects=`` below): SEVERAL, a step of it
# took more than one optimizer step (``runs.several_effects``); BETWEEN, the fault came between two of them (the rehearsal's phase there).
SEVERAL, BETWEEN = "several", "between"


def classify(diffs: list[Difference], steps_differ: bool = False, effects: str | None = None) -> list[str]:
    """The likely causes of one rank's differences, most specific first (``ORDER``). Where only
    parameters and optimizer state differ, every registered object's own state came back right:
    something unregistered steered training, or, in a step with several effects, the effects
    after the first were not applied exactly once (named first; alone when the fault came
    between them)."""
    if not diffs and not steps_differ:
        return []
    found = {c for c in map(cause_of, diffs) if c is not None}
    if steps_differ:
        found.add("steps")
    if not found:
        found |= {"effects"} if effects == BETWEEN else {"effects", "unregistered"} if effects == SEVERAL else {"unregistered"}
    return [c for c in ORDER if c in found]


def compare_rank(
    rank: int, ref: dict | None, got: dict | None, unstable: frozenset = frozenset(), effects: str | None = None
) -> RankVerdict:
    if ref is None:
        return RankVerdict(rank, missing="the fault-free run wrote no state for this rank")
    if got is None:
        return RankVerdict(rank, missing="no state written: no process held this rank at the end (the job failed)")
    diffs = differences(ref, got, unstable)
    attempts = [d for d in diffs if is_attempt_count(d.key, ref["entries"], got["entries"])]
    timings = [d for d in diffs if is_wall_clock(d.key, ref["entries"], got["entries"])]
    diffs = [d for d in diffs if d not in attempts and d not in timings]
    steps_differ = ref["meta"].get("steps") != got["meta"].get("steps") and "~meta/steps" not in unstable
    if steps_differ:
        diffs.append(Difference("~meta/steps", "meta", f"{ref['meta'].get('steps')} -> {got['meta'].get('steps')} steps"))
    return RankVerdict(rank, diffs, classify(diffs, steps_differ, effects), attempts=attempts, timings=timings)


def compare_files(ref: dict | None, got: dict | None, unstable: frozenset = frozenset()) -> RankVerdict:
    """The files the job wrote in its working directory (``{"entries", "roles"}`` as a rank's dump,
    keys under ``FILES``), against the fault-free run's: one verdict for the whole job."""
    if ref is None or got is None:
        return RankVerdict(None, missing=f"the working directory of the {'fault-free run' if ref is None else 'run'} was not read")
    diffs = differences(ref, got, unstable)
    timings = [d for d in diffs if is_wall_clock(d.key, ref["entries"], got["entries"])]
    diffs = [d for d in diffs if d not in timings]
    return RankVerdict(None, diffs, classify(diffs), timings=timings)


def compare_runs(
    ref: dict[int, dict], got: dict[int, dict], unstable: frozenset = frozenset(), effects: str | None = None
) -> list[RankVerdict]:
    """Per rank of the fault-free run (and any extra rank of the other)."""
    return [compare_rank(r, ref.get(r), got.get(r), unstable, effects) for r in sorted(set(ref) | set(got))]


def maybe_unseeded(dumps: dict[int, dict]) -> frozenset:
    """The keys of generators that may start from OS entropy (``MAYBE_UNSEEDED``)."""
    return frozenset(k for d in dumps.values() for k, role in d.get("roles", {}).items() if role == MAYBE_UNSEEDED)


def unstable_keys(ref: dict[int, dict], control: dict[int, dict]) -> frozenset:
    """Keys that differ between two fault-free runs (the script is not reproducible there):
    a fault cannot be blamed for them."""
    keys = set()
    for r in set(ref) & set(control):
        keys |= {d.key for d in differences(ref[r], control[r])}
        if ref[r]["meta"].get("steps") != control[r]["meta"].get("steps"):
            keys.add("~meta/steps")
    return frozenset(keys)
