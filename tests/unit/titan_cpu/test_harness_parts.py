"""The torchtitan harness's own decisions, without torchtitan: when the test kill fires, and the
offline inputs (deterministic, the tokenizer's ids within the model's vocabulary)."""

import json
import os
import sys

import pytest

HARNESS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "titan_cpu")
sys.path.insert(0, HARNESS_DIR)

from cpu_train import kill_point  # noqa: E402
from offline_assets import BOS, EOS, build, corpus  # noqa: E402


@pytest.mark.parametrize(
    "rank, step, env, marker_exists, fires",
    [
        (1, 6, {"TT_KILL_RANK": "1", "TT_KILL_STEP": "6"}, False, True),
        (0, 6, {"TT_KILL_RANK": "1", "TT_KILL_STEP": "6"}, False, False),  # another rank
        (1, 5, {"TT_KILL_RANK": "1", "TT_KILL_STEP": "6"}, False, False),  # another step
        (1, 6, {"TT_KILL_RANK": "1", "TT_KILL_STEP": "6", "TT_KILL_MARKER": "M"}, True, False),  # the restarted run: killed once
        (1, 6, {"TT_KILL_RANK": "1", "TT_KILL_STEP": "6", "TT_KILL_MARKER": "M"}, False, True),
        (0, 6, {}, False, False),  # no test variables: inert
        (0, 6, {"TT_KILL_STEP": "6"}, False, True),  # rank 0 by default
    ],
)
def test_the_kill_fires_once_at_its_rank_and_step(tmp_path, rank, step, env, marker_exists, fires):
    env = {k: (str(tmp_path / v) if k == "TT_KILL_MARKER" else v) for k, v in env.items()}
    if marker_exists:
        open(env["TT_KILL_MARKER"], "w").close()
    assert kill_point(rank, step, env) is fires
    second = {k.replace("TT_KILL", "TT_KILL2"): v for k, v in env.items()}  # the second kill's variables: the same rules
    assert kill_point(rank, step, second, "TT_KILL2") is fires and kill_point(rank, step, second) is False


def test_the_offline_inputs_are_deterministic_and_fit_the_vocabulary(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    assert corpus() == corpus()
    first, second = build(str(tmp_path / "one"), 512), build(str(tmp_path / "two"), 512)
    for key in ("hf_assets_path", "dataset_path"):
        for name in os.listdir(first[key]):
            with open(os.path.join(first[key], name)) as a, open(os.path.join(second[key], name)) as b:
                assert a.read() == b.read(), name
    tok = Tokenizer.from_file(os.path.join(first["hf_assets_path"], "tokenizer.json"))
    assert tok.get_vocab_size() <= 512 and tok.token_to_id(BOS) is not None and tok.token_to_id(EOS) is not None
    with open(os.path.join(first["hf_assets_path"], "tokenizer_config.json")) as f:
        assert json.load(f)["bos_token"] == BOS
