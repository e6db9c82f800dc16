"""An online PRM in GRPO runs: its state (weights, AdamW state, counters) travels in every
checkpoint, so a run stopped at step k and resumed ends as the uninterrupted run does, even when
the stop lands after the PRM has learned from part of the next step's groups (bundled tiny-arith
model, CPU). Two processes keeping equal PRMs: test_distributed.py."""

import json
import os
import signal

import pytest
import torch

from reasoning_from_scratch import checkpoints
from reasoning_from_scratch.arithmetic import make_split
from reasoning_from_scratch.checkpoints import (
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
    state_from_flat,
    state_to_flat,
)
from reasoning_from_scratch.online_prm import OnlinePRMStepScorer
from reasoning_from_scratch.prm import ProcessRewardModel, load_prm, save_prm
from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.training import TIMING_COLUMNS, GRPOConfig, train_grpo
from reasoning_from_scratch.weights import load_pretrained

TRAIN = make_split("train", 16, seed=5, levels=(1, 2))
HELD_OUT = make_split("val", 2, seed=5, levels=(1,))
STATE_FILE = "step_scorer.safetensors"


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    """A PRM on tiny-arith's backbone (a fresh head), saved as `online-prm:PATH` reads it."""
    model, tokenizer = load_pretrained("tiny-arith", device="cpu")
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("prm") / "prm"
    save_prm(ProcessRewardModel(backbone=model), tokenizer, out)
    return out


def _config(out, prm_dir, **kw):
    """3 steps of process supervision scored by an online PRM, a checkpoint after every step."""
    base = dict(steps=3, lr=1e-3, warmup_steps=0, prompts_per_step=2, num_rollouts=4,
                max_new_tokens=40, eval_every=0, eval_examples=2, eval_batch_size=2,
                sample_every=1, checkpoint_every=1, keep_checkpoints=0, seed=7,
                supervision="process", step_scorer=f"online-prm:{prm_dir}",
                process_variant="progress", output_dir=str(out), progress=False)
    return GRPOConfig(**{**base, **kw})


def _train(config, resume_from=None, hook=None):
    model, tokenizer = load_pretrained("tiny-arith", device="cpu")
    return train_grpo(model, tokenizer, TRAIN, HELD_OUT, "cpu", config,
                      resume_from=resume_from, phase_hook=hook)


def _outcome(run_dir):
    """What an interrupted and resumed run must share with the uninterrupted one: the metrics
    rows (times aside), the policy's weights and the PRM's final state."""
    rows = [{k: v for k, v in r.items() if k not in TIMING_COLUMNS}
            for r in read_metrics(run_dir / "metrics.csv")]
    weights = load_pretrained(run_dir / "final", device="cpu")[0].state_dict()
    prm = checkpoints.read_safetensors(run_dir / "final" / STATE_FILE)
    return rows, weights, prm


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, prm_dir):
    """The uninterrupted run the others are compared with."""
    out = tmp_path_factory.mktemp("straight") / "run"
    _train(_config(out, prm_dir))
    return _outcome(out)


def test_the_prm_learns_during_the_run(straight, prm_dir):
    """The comparisons below mean something: the PRM moved, its scores entered the rows."""
    rows, _, prm = straight
    start = checkpoints.read_safetensors(prm_dir / "model.safetensors")
    moved = [k for k in start if not torch.equal(prm[f"prm.backbone.{k}"], start[k])]
    assert moved, "the online PRM never updated: the resume tests would test nothing"
    assert all(r["proc_step_reward_mean"] == r["proc_step_reward_mean"] for r in rows)
    assert len({r["proc_step_reward_mean"] for r in rows}) == 3


def _ctrl_c_at(phase, step):
    def hook(p, s):
        if (p, s) == (phase, step):
            os.kill(os.getpid(), signal.SIGINT)
    return hook


def test_resume_after_step_1_ends_as_the_uninterrupted_run(tmp_path, prm_dir, straight):
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        _train(_config(out, prm_dir), hook=_ctrl_c_at("rollouts", 2))
    ckpt = find_checkpoint(out)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 1 and state["states"]["step_scorer"]["file"] == STATE_FILE
    _train(_config(out, prm_dir), resume_from=out)
    rows, weights, prm = _outcome(out)
    assert rows == straight[0]
    assert _same(weights, straight[1])
    assert _same(prm, straight[2])


def test_a_stop_after_the_prm_learned_from_the_next_step_still_resumes_exactly(
        tmp_path, prm_dir, straight, monkeypatch):
    """Ctrl-C lands in step 2's rollouts after the PRM has taken its update on the first group:
    the checkpoint holds the PRM as it was after step 1, not the half-updated one."""
    real, calls = OnlinePRMStepScorer.update, []

    def update_then_ctrl_c(self, *args, **kwargs):
        loss = real(self, *args, **kwargs)
        calls.append(loss)
        if len(calls) == 3:  # step 1 scored 2 groups; this is step 2's first
            os.kill(os.getpid(), signal.SIGINT)
        return loss

    monkeypatch.setattr(OnlinePRMStepScorer, "update", update_then_ctrl_c)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):  # no checkpoint after step 1: the stop writes it
        _train(_config(out, prm_dir, checkpoint_every=0, checkpoint_minutes=0))
    assert len(calls) == 3 and [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-1"]
    assert json.loads((find_checkpoint(out) / "trainer_state.json").read_text())["step"] == 1
    monkeypatch.setattr(OnlinePRMStepScorer, "update", real)
    _train(_config(out, prm_dir), resume_from=out)
    rows, weights, prm = _outcome(out)
    assert rows == straight[0]
    assert _same(weights, straight[1])
    assert _same(prm, straight[2])


# ---------------------------------------------------------------------------------------------
# The state through a checkpoint
# ---------------------------------------------------------------------------------------------

def _scorer(prm_dir, seed=None):
    prm, tokenizer = load_prm(prm_dir)
    if seed is not None:  # another PRM: its head drawn again
        torch.manual_seed(seed)
        torch.nn.init.normal_(prm.score_head.weight, std=0.5)
    return OnlinePRMStepScorer(prm, tokenizer, lr=1e-2)


def test_the_online_prm_state_round_trips_through_a_checkpoint(tmp_path, prm_dir):
    """A scorer that learned on a group, saved in a checkpoint, loads into a fresh scorer that
    then scores and learns exactly as the saved one does."""
    example = {"problem": "Compute 3+4", "answer": "7"}
    group = [[" <think>\nStep 1: 3+4=7\n", "</think>\n\\boxed{7}"],
             [" <think>\nStep 1: 3+4=8\n", "</think>\n\\boxed{8}"]]
    learned = _scorer(prm_dir)
    learned.score_group("P", group, example)
    model, tokenizer = load_pretrained("tiny-arith", device="cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(tmp_path / "checkpoint-1", model, tokenizer, optimizer, 1, {},
                           states={"step_scorer": learned.state_dict()})
    assert checkpoints.checkpoint_problem(path) is None
    fresh = _scorer(prm_dir, seed=1)
    assert not _same(fresh.prm.state_dict(), learned.prm.state_dict())
    load_checkpoint(path, model, optimizer, {"step_scorer": fresh})
    assert _same(fresh.prm.state_dict(), learned.prm.state_dict())
    assert fresh.cost() == learned.cost()
    assert fresh.score_group("P", group, example) == learned.score_group("P", group, example)
    assert _same(fresh.prm.state_dict(), learned.prm.state_dict())  # the same AdamW step
    assert fresh.optimizer.state_dict()["param_groups"] == \
        learned.optimizer.state_dict()["param_groups"]


def test_nested_state_keeps_key_types_tuples_and_tied_tensors():
    w = torch.arange(4.0)
    state = {"a": {0: w, "b": (0.9, 0.99), "c": [w, None, float("nan")]}, "tied": w}
    tensors, structure = state_to_flat(state)
    back = state_from_flat(tensors, json.loads(json.dumps(structure)))
    assert list(back["a"]) == [0, "b", "c"] and back["a"]["b"] == (0.9, 0.99)
    assert torch.equal(back["tied"], w) and back["a"]["c"][1] is None
    assert back["a"]["c"][2] != back["a"]["c"][2]  # NaN survives
    # the second and third views of w's storage are copies: safetensors holds no shared memory
    ptrs = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(ptrs) == len(tensors) == 3


def test_a_run_without_a_learner_writes_the_checkpoint_it_always_wrote(tmp_path):
    model, tokenizer = load_pretrained("tiny-arith", device="cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(tmp_path / "checkpoint-1", model, tokenizer, optimizer, 1, {})
    assert not list(path.glob("step_scorer*"))
    assert "states" not in json.loads((path / "trainer_state.json").read_text())


def test_an_older_checkpoint_without_the_prm_state_loads_with_a_warning(tmp_path, prm_dir):
    model, tokenizer = load_pretrained("tiny-arith", device="cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(tmp_path / "checkpoint-1", model, tokenizer, optimizer, 1, {})
    with pytest.warns(RuntimeWarning, match="holds no step_scorer state"):
        assert load_checkpoint(path, model, optimizer, {"step_scorer": _scorer(prm_dir)})[
            "step"] == 1


def test_a_truncated_prm_state_makes_the_checkpoint_unusable(tmp_path, prm_dir):
    model, tokenizer = load_pretrained("tiny-arith", device="cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(tmp_path / "checkpoint-1", model, tokenizer, optimizer, 1, {},
                           states={"step_scorer": _scorer(prm_dir).state_dict()})
    data = (path / STATE_FILE).read_bytes()
    (path / STATE_FILE).write_bytes(data[: len(data) // 2])
    assert STATE_FILE in checkpoints.checkpoint_problem(path)
