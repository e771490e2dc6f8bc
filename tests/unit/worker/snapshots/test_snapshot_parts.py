"""Snapshot parts in one process: the ring's placement (table), an image taken and loaded back
bitwise, the stream to a holder (a real socket) and what a holder keeps."""

import contextlib
import threading

import pytest
import torch

from tm_launch.worker.snapshots.image import Capture
from tm_launch.worker.snapshots.link import LinkError, SnapshotClient, SnapshotServer
from tm_launch.worker.snapshots.placement import holder_of, source_of


@pytest.mark.parametrize(
    "world, local_world, want",
    [
        pytest.param(4, 1, [1, 2, 3, 0], id="one worker per node: the next node"),
        pytest.param(8, 2, [2, 3, 4, 5, 6, 7, 0, 1], id="two per node: same local rank, next node"),
        pytest.param(4, 4, [1, 2, 3, 0], id="one node: the next rank (a worker's death, not the node's)"),
        pytest.param(1, 1, [None], id="one rank: nobody"),
    ],
)
def test_every_rank_has_one_holder_on_another_node_and_holds_one(world, local_world, want):
    holders = [holder_of(r, world, local_world) for r in range(world)]
    assert holders == want
    if world > 1:
        assert sorted(holders) == list(range(world))  # every rank holds exactly one snapshot
        assert all(source_of(h, world, local_world) == r for r, h in enumerate(holders))
        if local_world < world:
            assert all(h // local_world != r // local_world for r, h in enumerate(holders))  # never its own node


def _job():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _step(model, opt, sched, seed):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(32, 8, generator=g)).square().mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _flat(model, opt, sched):
    out = [t.clone() for t in model.state_dict().values()]
    out += [v.clone() for s in opt.state.values() for v in s.values()]
    return out, sched.state_dict()["last_epoch"], opt.param_groups[0]["lr"]


def test_an_image_loads_back_bitwise_and_the_copy_waits_for_nothing_but_the_optimizer():
    """The capture begins at a step's start; the forward then moves BatchNorm's running
    statistics before the background copy runs: the image still holds the start's values
    (buffers are copied at once, parameters and optimizer state later). Training on from the
    loaded image gives exactly what training on from the original gives."""
    model, opt, sched = _job()
    for s in range(3):
        _step(model, opt, sched, s)
    objects = {"model": model, "optimizer": opt, "scheduler": sched}
    want = _flat(model, opt, sched)
    capture = Capture(3, objects, per_rank={"rng": {"x": 1}}, reuse=None)
    x0 = torch.randn(32, 8, generator=torch.Generator().manual_seed(99))
    model(x0)  # the next step's forward: BatchNorm's running stats move
    image = capture.copy()
    assert image.step == 3 and image.per_rank == {"rng": {"x": 1}} and set(image.fingerprints()) == set(objects)
    for s in range(3, 6):
        _step(model, opt, sched, s)
    after_a = _flat(model, opt, sched)
    image.load_into(objects)
    got = _flat(model, opt, sched)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0])) and got[1:] == want[1:]
    model(x0)
    for s in range(3, 6):
        _step(model, opt, sched, s)
    after_b = _flat(model, opt, sched)
    assert all(torch.equal(a, b) for a, b in zip(after_a[0], after_b[0])) and after_a[1:] == after_b[1:]
    # The optimizer got tensors of its own: training on did not write into the image.
    image2 = Capture(3, objects, None, reuse=image).copy()
    assert image2.tensors is image.tensors  # same layout: the buffers are reused


def test_a_holder_keeps_the_images_its_source_may_return_to_and_answers_the_rank_that_replaces_it():
    """Each put says from which step on the holder keeps what it holds (the oldest step the job
    may return to, two before the newest with a snapshot every step); older images are dropped,
    their buffers reused."""
    model, opt, sched = _job()
    objects = {"model": model, "optimizer": opt}
    server = SnapshotServer("127.0.0.1")
    client = SnapshotClient(server.address, source=5)
    try:
        for step in range(4):
            _step(model, opt, sched, step)
            client.put_image(Capture(step, objects, None, reuse=None).copy().subset(["optimizer"]), keep_from=step - 2)
        client.put_mirror(4, True, b"rng")
        held = server.held()
        assert set(held) == {5} and sorted(held[5]["images"]) == [1, 2, 3] and held[5]["images"][3] == ("optimizer",)
        assert held[5]["mirrors"] == {4: True}
        joiner = SnapshotClient(server.address, source=9)
        image = joiner.get_image(5, 3, ["optimizer"])
        assert image.step == 3 and image.names() == ["optimizer"]
        fresh_model, fresh_opt, _ = _job()
        image.load_into({"optimizer": opt})
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                [v for s in opt.state.values() for v in s.values()],
                [v for s in Capture(3, objects, None, None).copy().states()["optimizer"]["state"].values() for v in s.values()],
            )
        )
        assert joiner.get_image(5, 0, None) is None and joiner.get_mirror(5, 4) == (True, b"rng")
        client.put_image(Capture(4, objects, None, reuse=None).copy().subset(["optimizer"]), keep_from=4)  # a resend after a change
        assert sorted(server.held()[5]["images"]) == [4]
        server.keep_only([])
        assert server.held() == {} and server.nbytes == 0
        joiner.close()
    finally:
        client.close()
        server.close()


def test_a_holder_that_is_gone_fails_the_send_at_once(refusing_port):
    with pytest.raises(LinkError):
        SnapshotClient(("127.0.0.1", refusing_port), source=0, timeout=2)
    server = SnapshotServer("127.0.0.1")
    client = SnapshotClient(server.address, source=0)
    server.close()
    model, opt, sched = _job()
    _step(model, opt, sched, 0)
    image = Capture(1, {"model": model}, None, None).copy()
    with pytest.raises(LinkError):  # its connections closed with it: a put raises instead of waiting
        client.put_image(image, keep_from=1)
    client.close()


def _module_tensors(image, name="model"):
    return list(image.states()[name].values())


def test_a_kept_module_walk_reads_the_tensors_where_they_are_now_and_is_dropped_when_they_change():
    """Captures reuse a module's walk (``plans``) while its state dict holds the same tensor
    objects: the image equals a fresh walk's, a parameter whose data was swapped is read from
    its new storage, a new parameter object or a new shape walks again, and a module whose state
    has a non-tensor value (an extra state) is walked every time."""
    model, opt, sched = _job()
    _step(model, opt, sched, 0)
    objects = {"model": model, "optimizer": opt, "scheduler": sched}
    plans: dict = {}
    first = Capture(1, objects, None, None, plans=plans).copy()
    plan = plans["model"]
    again = Capture(1, objects, None, None, plans=plans).copy()
    fresh = Capture(1, objects, None, None).copy()
    assert plans["model"] is plan and again.skeleton == fresh.skeleton == first.skeleton
    assert all(torch.equal(a, b) for a, b in zip(again.tensors, fresh.tensors))
    model[0].weight.data = torch.full_like(model[0].weight, 7.0)  # same Parameter object, new storage
    swapped = Capture(2, objects, None, None, plans=plans).copy()
    assert plans["model"] is plan and torch.equal(_module_tensors(swapped)[0], torch.full((16, 8), 7.0))
    model[2].weight = torch.nn.Parameter(torch.zeros(4, 16))  # a new object: walked again
    replaced = Capture(3, objects, None, None, plans=plans).copy()
    assert plans["model"] is not plan and torch.equal(_module_tensors(replaced)[-2], torch.zeros(4, 16))
    plan = plans["model"]
    model[2].weight.data = torch.zeros(3, 16)  # same object, another shape: walked again
    reshaped = Capture(4, objects, None, None, plans=plans).copy()
    assert plans["model"] is not plan and _module_tensors(reshaped)[-2].shape == (3, 16)

    class Counted(torch.nn.Linear):
        calls = 0

        def get_extra_state(self):
            Counted.calls += 1
            return {"calls": Counted.calls}

        def set_extra_state(self, state):
            pass

    counted = Counted(2, 2)
    for step in range(2):
        image = Capture(step, {"m": counted}, None, None, plans=plans).copy()
        assert image.states()["m"]["_extra_state"] == {"calls": step + 1}


def test_an_image_travels_as_a_few_pieces_of_one_buffer_and_arrives_bitwise():
    """An image's tensors are views of one host buffer at aligned offsets, in placeholder order:
    the subset a holder keeps (objects that are not neighbours in that order) is sent as one
    piece per run of adjacent tensors and arrives in one buffer, bitwise; a header that does
    not match the bytes it announces is refused."""
    from tm_launch.worker.snapshots.link import _image_header, _recv_image
    from tm_launch.worker.state import transfer

    model, opt, sched = _job()
    _step(model, opt, sched, 0)
    objects = {"a_model": model, "b_scheduler": sched, "c_optimizer": opt}
    image = Capture(1, objects, None, None).copy()
    assert all(t.untyped_storage().data_ptr() == image.flat.untyped_storage().data_ptr() for t in image.tensors)
    assert all(offset % transfer.ALIGN == 0 for offset, _ in image.spans)
    sub = image.subset(["a_model", "c_optimizer"])  # the scheduler holds no tensor: the runs are adjacent
    assert len(sub.wire_chunks()) == 1 and sum(len(c) for c in sub.wire_chunks()) == _image_header("x", 0, sub)["nbytes"]
    only_opt = image.subset(["c_optimizer"])
    server = SnapshotServer("127.0.0.1")
    client = SnapshotClient(server.address, source=3)
    try:
        client.put_image(only_opt, keep_from=1)
        client.put_image(sub, keep_from=1)
        got = SnapshotClient(server.address, source=4).get_image(3, 1, ["c_optimizer"])
        assert len(got.tensors) == len(only_opt.tensors) and all(torch.equal(a, b) for a, b in zip(got.tensors, only_opt.tensors))
        assert got.flat is not None and got.skeleton == only_opt.skeleton
    finally:
        client.close()
        server.close()

    class Wire:  # a socket that hands out what was sent
        def __init__(self, data):
            self.data = memoryview(data)

        def recv_into(self, view):
            n = min(len(view), len(self.data))
            view[:n] = self.data[:n]
            self.data = self.data[n:]
            return n

    header = _image_header("put_image", 0, only_opt)
    data = b"".join(bytes(c) for c in only_opt.wire_chunks())
    back = _recv_image(Wire(data), header)
    assert all(torch.equal(a, b) for a, b in zip(back.tensors, only_opt.tensors))
    with pytest.raises(LinkError, match="announces"):
        _recv_image(Wire(data), {**header, "nbytes": header["nbytes"] + 64})


def test_a_stand_in_for_a_module_has_its_parameters_copied_off_the_main_thread():
    """An object registered for a module (``parts()``: torchtitan's ``ModelTensors``) holding the
    module's parameters: those are copied with the optimizer's state, after the boundary (on a
    GPU the boundary's copy is synchronous); its other tensors (a buffer, a copy of a
    parameter) at once. The image holds the start's values either way."""

    class Tensors:
        def __init__(self, module):
            self.module = module

        def parts(self):
            return [self.module]

        def state_dict(self):
            state = {n: p.detach() for n, p in self.module.named_parameters()}
            state["copy"] = self.module[0].weight.detach().clone()
            state.update((n, b.detach()) for n, b in self.module.named_buffers())
            return state

        def load_state_dict(self, state):
            pass

    model, opt, sched = _job()
    _step(model, opt, sched, 0)
    stand_in = Tensors(model)
    capture = Capture(1, {"model": stand_in, "optimizer": opt}, None, None)
    names = list(stand_in.state_dict())
    later_names = {names[i] for i in capture._later if i < len(names)}
    assert later_names == {n for n, _ in model.named_parameters()}  # not the copy, not the buffers
    want = {n: t.clone() for n, t in stand_in.state_dict().items()}
    model(torch.randn(32, 8))  # the next forward moves BatchNorm's statistics
    image = capture.copy()
    assert all(torch.equal(image.states()["model"][n], t) for n, t in want.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (docs/gpus.md says where this ran)")
def test_a_cuda_image_is_copied_on_a_side_stream_into_pinned_memory_and_adds_no_gpu_memory():
    """On a GPU the boundary queues the parameters' and optimizer state's copy on a side stream
    that waits for the step's work so far, into pinned host buffers: the next forward, queued
    on the main stream meanwhile, changes nothing the image holds; the copy allocates no GPU
    memory; the image loads back bitwise, and training on from it gives what training on from
    the original gives. A second image of the same layout reuses the first one's buffers."""
    device = torch.device("cuda")
    model, opt, sched = _job()
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    def step(seed):
        g = torch.Generator().manual_seed(seed)
        model(torch.randn(32, 8, generator=g).to(device)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    for s in range(3):
        step(s)
    objects = {"model": model, "optimizer": opt, "scheduler": sched}
    torch.cuda.synchronize()
    want = _flat(model, opt, sched)
    devices = [v.device.type for s in opt.state.values() for v in s.values()]
    assert "cpu" in devices and "cuda" in devices  # AdamW counts its steps on the CPU, the moments on the GPU
    x = torch.randn(4096, 8, device=device)
    allocated = torch.cuda.memory_allocated()
    capture = Capture(3, objects, per_rank=None, reuse=None)
    assert capture._stream is not None and capture.image.flat.is_pinned()
    model(x)  # queued on the main stream: BatchNorm's running statistics move
    image = capture.copy()
    assert all(t.device.type == "cpu" for t in image.tensors)
    assert torch.cuda.memory_allocated() == allocated  # nothing of the copy stayed on the GPU
    for s in range(3, 6):
        step(s)
    after_a = _flat(model, opt, sched)
    image.load_into(objects)
    got = _flat(model, opt, sched)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got[0], want[0])) and got[1:] == want[1:]
    assert [v.device.type for s in opt.state.values() for v in s.values()] == devices  # where the optimizer kept them
    model(x)
    for s in range(3, 6):
        step(s)
    after_b = _flat(model, opt, sched)
    assert all(torch.equal(a, b) for a, b in zip(after_a[0], after_b[0])) and after_a[1:] == after_b[1:]
    image2 = Capture(3, objects, None, reuse=image).copy()
    assert image2.flat is image.flat  # same layout: the pinned buffer is reused


def test_plain_optimizer_state_is_left_where_it_arrives_for_torchs_own_load_to_place():
    """Which tensors a load hands over as they arrived (``transfer.left_on_the_host``): an
    optimizer's plain tensors when it loads with torch's own ``Optimizer.load_state_dict``
    (which puts each where that optimizer keeps it: a GPU job's AdamW counts steps on the
    CPU); not a module's, not those of an optimizer with a load of its own."""
    from tm_launch.worker.state.transfer import flatten, left_on_the_host

    model, opt, sched = _job()
    _step(model, opt, sched, 0)

    class OwnLoad(torch.optim.SGD):
        def load_state_dict(self, state):
            super().load_state_dict(state)

    other = OwnLoad(model.parameters(), lr=0.1, momentum=0.9)
    other.step()
    objects = {"model": model, "opt": opt, "other": other, "sched": sched}
    tensors: list = []
    skeleton = {name: flatten(obj.state_dict(), tensors) for name, obj in objects.items()}
    start = len(model.state_dict())  # the model's tensors come first, one placeholder each
    n_opt = sum(len(s) for s in opt.state.values())
    assert left_on_the_host(skeleton, objects) == set(range(start, start + n_opt))


@contextlib.contextmanager
def _a_rank_whose_holder_holds_back(monkeypatch, overlap: bool):
    """One rank's ``Snapshots`` (``overlap``: ``--snapshot-send overlap``) and a real holder
    over loopback that takes no image until the yielded event is set."""
    from tm_launch.worker.snapshots import link
    from tm_launch.worker.snapshots.service import Snapshots

    arrive = threading.Event()
    real = link._recv_image

    def held_back(sock, header, reuse=None):
        assert arrive.wait(30)
        return real(sock, header, reuse)

    monkeypatch.setattr(link, "_recv_image", held_back)
    holder = SnapshotServer("127.0.0.1")
    holder.keep_only([0])
    snaps = Snapshots("127.0.0.1", every=1, memory_limit=0, local_world=1, overlap_send=overlap)
    try:
        snaps.set_remote(["model", "optimizer"], generation=0)
        snaps.enter(0, 2, lambda r: holder.address)
        yield snaps, holder, arrive
    finally:
        snaps.close()
        holder.close()


def _gives_up_after(tries: int):
    asked = []
    return lambda: asked.append(1) or len(asked) > tries


def test_with_snapshot_send_commit_a_step_commits_once_its_own_snapshot_is_on_the_holder(monkeypatch):
    """``--snapshot-send commit`` (the default): ``ready_to_commit(s)`` waits for the local copy
    of ``s`` and for ``s`` on the holder. Held back at the holder, the send of step 0 holds step
    0's commit until it arrives. Every rank and its holder keep two images: the one the job may
    return to (the last committed step's) and the newest."""
    model, opt, sched = _job()
    objects = {"model": model, "optimizer": opt}
    with _a_rank_whose_holder_holds_back(monkeypatch, overlap=False) as (snaps, holder, arrive):
        snaps.boundary(0, objects, None)
        assert not snaps.ready_to_commit(0, give_up=_gives_up_after(3))  # waits for its own send
        arrive.set()
        assert snaps.ready_to_commit(0, give_up=lambda: False) and snaps.holds_own(0)
        for step in range(6):
            _step(model, opt, sched, step)
            snaps.boundary(step + 1, objects, None)
            assert snaps.ready_to_commit(step + 1, give_up=lambda: False) and snaps.holds_own(step + 1)
        snaps.wait_idle()
        assert sorted(snaps.local_digests()) == [5, 6] and sorted(holder.held()[0]["images"]) == [5, 6]
        assert snaps.kept_images == 2


def test_with_snapshot_send_overlap_a_step_commits_once_its_copy_is_done_and_the_snapshot_before_it_is_on_the_holder(monkeypatch):
    """``--snapshot-send overlap``: the send of a step's snapshot overlaps the next step:
    ``ready_to_commit(s)`` waits for the local copy of ``s`` and for every earlier snapshot on
    the holder, not for ``s``'s own send. Held back at the holder, the send of step 0 lets step
    0 commit and holds step 1's commit until it arrives. Every rank and its holder keep the
    images the job may return to (the one before the last commit on): three with a snapshot
    every step."""
    model, opt, sched = _job()
    objects = {"model": model, "optimizer": opt}
    with _a_rank_whose_holder_holds_back(monkeypatch, overlap=True) as (snaps, holder, arrive):
        snaps.boundary(0, objects, None)
        assert snaps.ready_to_commit(0, give_up=lambda: False)  # its own send is still held back
        _step(model, opt, sched, 0)
        snaps.boundary(1, objects, None)
        assert not snaps.ready_to_commit(1, give_up=_gives_up_after(3))  # waits for step 0's send
        arrive.set()
        assert snaps.ready_to_commit(1, give_up=lambda: False)
        for step in range(1, 6):
            _step(model, opt, sched, step)
            snaps.boundary(step + 1, objects, None)
            assert snaps.ready_to_commit(step + 1, give_up=lambda: False)
        snaps.wait_idle()
        assert sorted(snaps.local_digests()) == [4, 5, 6] and sorted(holder.held()[0]["images"]) == [4, 5, 6]
        assert snaps.kept_images == 3
