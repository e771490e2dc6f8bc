"""The rehearsal's reading of a run's working directory (``tm_launch.rehearsal.files``): a
``torch.save`` file as the tensors and values in it, a DCP checkpoint as its whole state dict,
any other file as its bytes; symbolic links are not followed."""

import json
import os

import torch
import torch.distributed.checkpoint as dcp

from tm_launch.rehearsal.compare import FileBytes, compare_files
from tm_launch.rehearsal.files import read_files


def test_a_torch_save_file_is_read_as_its_tensors_and_values(tmp_path):
    torch.save({"model": {"w": torch.arange(3.0)}, "seen": 8, "name": "run"}, tmp_path / "final.pt")
    entries = read_files(str(tmp_path))["entries"]
    assert set(entries) == {"~file/final.pt:model.w", "~file/final.pt:seen", "~file/final.pt:name"}
    assert torch.equal(entries["~file/final.pt:model.w"], torch.arange(3.0)) and entries["~file/final.pt:seen"] == 8


def test_other_files_are_their_bytes_and_links_are_not_followed(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "loss.txt").write_text("0.5\n")
    (tmp_path / "data.zip").write_bytes(b"PK\x03\x04 not really a zip")
    os.symlink("/etc/hostname", tmp_path / "link")
    read = read_files(str(tmp_path))
    entries = read["entries"]
    assert sorted(entries) == ["~file/data.zip", "~file/logs/loss.txt"]
    loss = entries["~file/logs/loss.txt"]
    assert isinstance(loss, FileBytes) and loss.size == 4 and loss.content == b"0.5\n"
    assert set(read["roles"].values()) == {"file"}


def test_a_dcp_checkpoint_is_read_whole_and_a_changed_tensor_in_it_is_named(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    dcp.save({"model": {"w": torch.zeros(4)}, "step": 3}, checkpoint_id=str(a / "ckpt"), no_dist=True)
    dcp.save({"model": {"w": torch.tensor([0.0, 0.0, 1.0, 0.0])}, "step": 3}, checkpoint_id=str(b / "ckpt"), no_dist=True)
    ra, rb = read_files(str(a)), read_files(str(b))
    assert set(ra["entries"]) == {"~file/ckpt:model.w", "~file/ckpt:step"}
    verdict = compare_files(ra, rb)
    assert [d.key for d in verdict.differences] == ["~file/ckpt:model.w"] and verdict.causes == ["file"]


def test_an_empty_or_missing_directory_has_no_files(tmp_path):
    assert read_files(str(tmp_path))["entries"] == {}
    assert read_files(str(tmp_path / "none"))["entries"] == {}


def test_a_json_file_is_its_values_its_wall_clock_named_apart_and_the_runs_own_path_unplaced(tmp_path):
    def run(name: str, runtime: float, loss: float) -> dict:
        cwd = tmp_path / name
        cwd.mkdir()
        state = {"log_history": [{"loss": loss}, {"train_runtime": runtime}], "best": str(cwd / "checkpoint-2")}
        (cwd / "trainer_state.json").write_text(json.dumps(state))
        (cwd / "paths.txt").write_text(f"saved to {cwd}/model.pt\n")
        return read_files(str(cwd))

    ref = run("ref", 1.5, 0.25)
    assert ref["entries"]["~file/trainer_state.json:best"] == "<cwd>/checkpoint-2"
    same = compare_files(ref, run("same", 2.5, 0.25))
    assert same.equal and [d.key for d in same.timings] == ["~file/trainer_state.json:log_history.1.train_runtime"]
    other = compare_files(ref, run("other", 1.5, 0.5))
    assert [d.key for d in other.differences] == ["~file/trainer_state.json:log_history.0.loss"]
