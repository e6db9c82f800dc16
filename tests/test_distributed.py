"""Data-parallel GRPO: `torchrun --nproc-per-node 2 chapters/ch07_train.py` on two CPU processes
(Gloo) makes the one-process run, rank 0 alone writes, Ctrl-C on one rank leaves a checkpoint
that resumes exactly, an online PRM stays the same on every process; and the pieces: per-prompt
generators, sharded rollouts and advantages, dynamic sampling's cut, the interrupt hand-over,
the whole-step process hook."""

import copy
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rollout_helpers import rollouts_from_texts
from tolerance import assert_trained_alike, saved_weights

from reasoning_from_scratch import distributed, systems, training
from reasoning_from_scratch.checkpoints import state_to_flat
from reasoning_from_scratch.generation import row_uniforms, sample_next_token
from reasoning_from_scratch.grpo import RolloutBatch, collect_rollouts
from reasoning_from_scratch.interrupts import defer_interrupts, record_interrupts
from reasoning_from_scratch.online_prm import OnlinePRMStepScorer
from reasoning_from_scratch.prm import ProcessRewardModel, load_prm, save_prm
from reasoning_from_scratch.process_supervision import ProcessAdvantageFn
from reasoning_from_scratch.prompts import render_prompt
from reasoning_from_scratch.run_dir import check_states_agree
from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.training import TIMING_COLUMNS, rollout_generators
from reasoning_from_scratch.weights import load_pretrained, read_safetensors, resolve_model_dir

pytestmark = pytest.mark.slow  # process groups under torchrun: pyproject.toml's markers

ROOT = Path(__file__).resolve().parents[1]

# The bundled model (its rollouts earn rewards, so the updates are real) on short level-1/2
# problems; DAPO's token-mean loss, batch-std advantages, dynamic sampling, micro-batches, two
# inner epochs and a KL reference: every place where the processes must agree. In float64, so
# runs that sum in another order agree far beyond rounding (tests/tolerance.py).
FLAGS = ["--dtype", "float64", "--steps", "3", "--prompts-per-step", "4", "--num-rollouts", "4",
         "--max-new-tokens", "48", "--eval-examples", "4", "--eval-every", "2",
         "--eval-batch-size", "2", "--train-examples", "64", "--train-level-weights",
         "1,1,0,0,0", "--sample-every", "1", "--lr", "1e-3", "--warmup-steps", "0",
         "--loss-type", "dapo", "--scale-rewards", "batch", "--dynamic-sampling",
         "--micro-batch-size", "3", "--inner-epochs", "2", "--beta", "0.04",
         "--threads", "1", "--device", "cpu", "--no-progress"]
# A torchrun run here takes 8-15 s; one still going after this is stuck.
TIMEOUT_S = 120
REWARD_COLUMNS = ("reward_mean", "reward_std", "correct_mean", "format_mean", "zero_adv_frac",
                  "len_mean", "gen_tokens", "sampling_rounds")

# Each torchrun worker runs the chapter script under an audit hook that records every file it
# creates, writes, renames or removes under the run directory (including safetensors' and
# matplotlib's, which go through mkstemp / open / os.replace), one log per rank. INTERRUPT_AT
# "rank,phase,step" sends that rank alone a real SIGINT when the phase starts. STOP_AT
# "rank,phase,step,file": when the phase starts, that rank creates the file and waits until a
# stop signal reaches it (the test sends torchrun SIGTERM, which torchrun passes on).
WORKER = r'''
import os, runpy, signal, sys
log_pattern, watched, script, *flags = sys.argv[1:]
watched = os.path.realpath(watched)
log = open(log_pattern % os.environ["RANK"], "w", buffering=1)
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

def inside(path):
    if not isinstance(path, (str, bytes, os.PathLike)):
        return False
    return os.path.realpath(os.fsdecode(path)).startswith(watched)

def audit(event, args):
    if event == "open":
        path, mode, flags_ = args
        writes = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            mode is None and flags_ & WRITE)
        if writes and inside(path):
            log.write(f"open {path}\n")
    elif event == "os.rename":  # os.replace too: the last step of every atomic write
        if inside(args[0]) or inside(args[1]):
            log.write(f"{event} {args[0]} -> {args[1]}\n")
    elif event in ("os.remove", "os.mkdir", "os.rmdir", "shutil.rmtree"):
        if inside(args[0]):
            log.write(f"{event} {args[0]}\n")

sys.addaudithook(audit)
# Ctrl-C raises, as in a terminal, even when the test run itself ignores SIGINT (a shell starts
# background jobs with SIGINT ignored, and the ignoring is inherited by every child process)
signal.signal(signal.SIGINT, signal.default_int_handler)
if os.environ.get("INTERRUPT_AT"):
    who, phase, step = os.environ["INTERRUPT_AT"].split(",")
    if os.environ["RANK"] == who:
        from reasoning_from_scratch.cli import train as training_cli
        real = training_cli.train_grpo

        def hooked(*args, **kwargs):
            def hook(p, s):
                if (p, s) == (phase, int(step)):
                    os.kill(os.getpid(), signal.SIGINT)
            return real(*args, phase_hook=hook, **kwargs)
        training_cli.train_grpo = hooked
if os.environ.get("STOP_AT"):
    import time
    who, phase, step, reached = os.environ["STOP_AT"].split(",")
    got, real_signal = [], signal.signal

    def observed(signum, handler):  # note every stop signal that arrives
        if callable(handler) and signum != signal.SIGINT:
            inner = handler
            def handler(s, f):
                got.append(s)
                return inner(s, f)
        return real_signal(signum, handler)
    signal.signal = observed
    if os.environ["RANK"] == who:
        from reasoning_from_scratch.cli import train as training_cli
        real_stop = training_cli.train_grpo

        def waiting(*args, **kwargs):
            def hook(p, s):
                if (p, s) == (phase, int(step)):
                    open(reached, "w").close()
                    deadline = time.time() + 60
                    while not got and time.time() < deadline:
                        time.sleep(0.01)
            return real_stop(*args, phase_hook=hook, **kwargs)
        training_cli.train_grpo = waiting
sys.argv = [script, *flags]
runpy.run_path(script, run_name="__main__")
'''


def _torchrun(tmp, out, flags, interrupt_at=None, processes=2, sigterm_at=None):
    """`torchrun --standalone --nproc-per-node N ch07_train.py flags` (audited); returns the
    finished process and the files each rank wrote {rank: [lines]}. sigterm_at "rank,phase,step":
    torchrun gets SIGTERM once that rank reaches that phase."""
    worker = tmp / "worker.py"
    worker.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("INTERRUPT_AT", None)
    env.pop("STOP_AT", None)
    if interrupt_at:
        env["INTERRUPT_AT"] = interrupt_at
    reached = tmp / f"reached-{out.name}"
    if sigterm_at:
        env["STOP_AT"] = f"{sigterm_at},{reached}"
    logs = str(tmp / f"writes-{out.name}-%s.txt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(processes), str(worker), logs, str(out),
           str(ROOT / "chapters" / "ch07_train.py"), *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + TIMEOUT_S
    while sigterm_at and not reached.exists() and proc.poll() is None \
            and time.time() < deadline:
        time.sleep(0.02)
    if sigterm_at and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # as a scheduler stops a job: torchrun passes it on
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:  # ranks waiting for each other: a failure, not a hang
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on to its workers, then kills
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"torchrun still running after {TIMEOUT_S} s (ranks deadlocked?):\n"
                    f"{stdout[-2000:]}\n{stderr[-2000:]}")
    writes = {r: (tmp / f"writes-{out.name}-{r}.txt").read_text().splitlines()
              for r in range(processes)}
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), writes


def _weights(run_dir):
    return saved_weights(run_dir / "final")  # as saved: float64


def _start():
    return saved_weights(resolve_model_dir("tiny-arith"), torch.float64)  # exact: from float32


def _rows(run_dir):
    return [{k: v for k, v in r.items() if k not in TIMING_COLUMNS}
            for r in read_metrics(run_dir / "metrics.csv")]


def _ch07_main():
    """chapters/ch07_train.py's `main`, run in this process (the one-process run)."""
    spec = importlib.util.spec_from_file_location("ch07_train",
                                                  ROOT / "chapters" / "ch07_train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.main


def _run_here(argv):
    """chapters/ch07_train.py with `argv` in this process; torch's thread count restored."""
    threads = torch.get_num_threads()
    try:
        return _ch07_main()(argv)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 3 steps by two processes (torchrun, reporting to TensorBoard when it is
    installed) and by one (the script, in this process)."""
    tmp = tmp_path_factory.mktemp("ddp")
    two, one = tmp / "two", tmp / "one"
    report = ["--report-to", "tensorboard"] if importlib.util.find_spec("tensorboard") else []
    proc, writes = _torchrun(tmp, two, ["--output-dir", str(two), *FLAGS, *report])
    assert proc.returncode == 0, proc.stderr[-3000:]
    _run_here(["--output-dir", str(one), *FLAGS])
    return {"tmp": tmp, "two": two, "one": one, "writes": writes, "stdout": proc.stdout}


def test_two_processes_make_the_one_process_run(runs):
    two, one = runs["two"], runs["one"]
    rows2 = read_metrics(two / "metrics.csv")
    rows1 = read_metrics(one / "metrics.csv")
    assert [r["step"] for r in rows2] == [1.0, 2.0, 3.0]
    for r1, r2 in zip(rows1, rows2, strict=True):
        assert {c: r2[c] for c in REWARD_COLUMNS} == {c: r1[c] for c in REWARD_COLUMNS}
        assert r2["eval_accuracy"] == r1["eval_accuracy"]
    assert any(r["sampling_rounds"] > 1 for r in rows2)  # dynamic sampling drew more prompts
    assert any(r["grad_norm"] for r in rows2)  # real updates, not all-equal groups
    assert (two / "samples.jsonl").read_text() == (one / "samples.jsonl").read_text()
    assert_trained_alike(_weights(two), _weights(one), _start())
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert (s1["world_size"], s2["world_size"]) == (1, 2)
    skip = ("wall_seconds", "output_dir", "world_size")
    assert {k: v for k, v in s2.items() if k not in skip} == \
        {k: v for k, v in s1.items() if k not in skip}
    assert json.loads((two / "config.json").read_text())["world_size"] == 2


@pytest.mark.parametrize("scorer,variant", [("verifier-think", "progress"),
                                             ("mc-branch", "value-delta")])
def test_two_processes_train_with_the_process_forms(tmp_path, scorer, variant):
    """Every process scores its own groups (the Monte-Carlo scorer samples with the policy)."""
    out = tmp_path / "run"
    flags = ["--steps", "2", "--prompts-per-step", "2", "--num-rollouts", "4",
             "--max-new-tokens", "40", "--eval-examples", "2", "--eval-every", "0",
             "--train-examples", "32", "--supervision", "process", "--step-scorer", scorer,
             "--process-variant", variant, "--mc-rollouts", "2", "--threads", "1",
             "--device", "cpu", "--no-progress"]
    proc, _ = _torchrun(tmp_path, out, ["--output-dir", str(out), *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out / "metrics.csv")
    assert [r["step"] for r in rows] == [1.0, 2.0]
    config = json.loads((out / "config.json").read_text())
    assert (config["step_scorer"], config["process_variant"]) == (scorer, variant)


def test_only_rank_0_writes_files(runs):
    two, writes = runs["two"], runs["writes"]
    assert writes[1] == []
    written = "\n".join(writes[0])
    for name in ("metrics.csv", "samples.jsonl", "summary.json", "config.json", "data.json",
                 "metrics.png", "final", "reference"):
        assert str(two / name) in written, name
    if importlib.util.find_spec("tensorboard"):  # one event file, rank 0's
        assert len(list((two / "tensorboard").glob("events.out.tfevents.*"))) == 1
        assert str(two / "tensorboard") in written
    assert runs["stdout"].count('"world_size": 2') == 1  # one summary printed, by rank 0


@pytest.mark.parametrize("phase,step,holds,resume_with", [
    ("rollouts", 2, 1, 2),  # rank 1 interrupted mid-step: every rank stops before the update
    ("update", 2, 2, 1),  # inside the update: finished, then stopped; resumed by one process
])
def test_ctrl_c_on_one_rank_stops_all_with_a_checkpoint_that_resumes(
        runs, phase, step, holds, resume_with):
    tmp = runs["tmp"]
    out = tmp / f"interrupted-{phase}"
    proc, writes = _torchrun(tmp, out, ["--output-dir", str(out), *FLAGS],
                             interrupt_at=f"1,{phase},{step}")
    assert proc.returncode != 0
    assert f"interrupted: {out / f'checkpoint-{holds}'} holds {holds} update(s)" in proc.stdout
    state = json.loads((out / f"checkpoint-{holds}" / "trainer_state.json").read_text())
    assert state["step"] == holds and state["world_size"] == 2
    assert [r["step"] for r in read_metrics(out / "metrics.csv")] == \
        [float(s) for s in range(1, holds + 1)]
    assert writes[1] == []
    proc, _ = _torchrun(tmp, out, ["--resume", str(out), "--no-progress", "--threads", "1"],
                        processes=resume_with)
    assert proc.returncode == 0, proc.stderr[-3000:]
    w, w_straight = _weights(out), _weights(runs["two"])
    rows, rows_straight = _rows(out), _rows(runs["two"])
    if resume_with == 2:  # the same processes doing the same sums: bit for bit
        assert all(torch.equal(w[k], w_straight[k]) for k in w)
        assert rows == rows_straight
    else:
        assert_trained_alike(w, w_straight, _start())
        assert [{c: r[c] for c in REWARD_COLUMNS} for r in rows] == \
            [{c: r[c] for c in REWARD_COLUMNS} for r in rows_straight]


def test_sigterm_to_torchrun_stops_every_rank_with_a_checkpoint_that_resumes(runs):
    tmp = runs["tmp"]
    out = tmp / "sigterm"
    # rank 1 waits at the start of step 2's rollouts; rank 0 is then inside them (waiting for
    # rank 1): both stop where they next agree, after the rollouts, before the update
    proc, writes = _torchrun(tmp, out, ["--output-dir", str(out), *FLAGS],
                             sigterm_at="1,rollouts,2")
    assert proc.returncode != 0  # torchrun reports the signal it got; its workers exit 75
    assert f"stopped by SIGTERM: {out / 'checkpoint-1'} holds 1 update(s)" in proc.stdout, \
        proc.stderr[-3000:]
    assert json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())["step"] == 1
    assert writes[1] == []
    proc, _ = _torchrun(tmp, out, ["--resume", str(out), "--no-progress", "--threads", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    w, w_straight = _weights(out), _weights(runs["two"])
    assert all(torch.equal(w[k], w_straight[k]) for k in w)
    assert _rows(out) == _rows(runs["two"])


def test_two_processes_log_the_one_process_step_statistics(tmp_path):
    """Process supervision (verifier steps) with dynamic sampling: each process scores its own
    groups, and the proc_ columns come from the gathered samples, so they are the one-process
    run's."""
    flags = ["--steps", "2", "--prompts-per-step", "4", "--num-rollouts", "4",
             "--max-new-tokens", "48", "--eval-examples", "2", "--eval-every", "0",
             "--eval-batch-size", "2", "--train-examples", "32", "--train-level-weights",
             "1,1,0,0,0", "--sample-every", "1", "--lr", "1e-3", "--warmup-steps", "0",
             "--supervision", "process", "--step-scorer", "verifier", "--dynamic-sampling",
             "--threads", "1", "--device", "cpu", "--no-progress"]
    two, one = tmp_path / "two", tmp_path / "one"
    proc, _ = _torchrun(tmp_path, two, ["--output-dir", str(two), *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    _run_here(["--output-dir", str(one), *flags])
    columns = [*training.PROCESS_COLUMNS.values(), *REWARD_COLUMNS]
    rows1, rows2 = _rows(one), _rows(two)
    assert [{c: r[c] for c in columns} for r in rows2] == \
        [{c: r[c] for c in columns} for r in rows1]
    assert all(0.0 <= r["proc_step_correct_rate"] <= 1.0 for r in rows2)
    assert any(r["sampling_rounds"] > 1 for r in rows2)  # groups of several rounds pooled


# ----------------------------------------------------------------------------------------------
# An online PRM: re-fitted on every group, the same on every process
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    """A PRM on the bundled model's backbone (a fresh head), as `online-prm:PATH` reads it."""
    model, tokenizer = load_pretrained("tiny-arith", device="cpu")
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("prm") / "prm"
    save_prm(ProcessRewardModel(backbone=model), tokenizer, out)
    return out


def test_two_processes_keep_the_one_process_online_prm(tmp_path, prm_dir):
    """Each process scores its share of every step's groups; the online PRM's updates must see
    them all, in order (`systems.WholeStepHook`): the run ends (its check that the PRM copies
    agree passes) with the one-process run's PRM, rows and samples."""
    flags = ["--dtype", "float64", "--steps", "2", "--prompts-per-step", "4",
             "--num-rollouts", "4", "--max-new-tokens", "40", "--eval-examples", "2",
             "--eval-every", "0", "--eval-batch-size", "2", "--train-examples", "32",
             "--train-level-weights", "1,1,0,0,0", "--sample-every", "1", "--lr", "1e-3",
             "--warmup-steps", "0", "--supervision", "process", "--step-scorer",
             f"online-prm:{prm_dir}", "--process-variant", "progress", "--threads", "1",
             "--device", "cpu", "--no-progress"]
    two, one = tmp_path / "two", tmp_path / "one"
    proc, _ = _torchrun(tmp_path, two, ["--output-dir", str(two), *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    _run_here(["--output-dir", str(one), *flags])
    prm2, prm1 = (read_safetensors(d / "final" / "step_scorer.safetensors") for d in (two, one))
    assert prm2.keys() == prm1.keys() and all(torch.equal(prm2[k], prm1[k]) for k in prm1)
    start = read_safetensors(prm_dir / "prm_head.safetensors")
    assert not all(torch.equal(prm1[f"prm.score_head.{k}"], start[k]) for k in start)  # learned
    # (not forward_tokens: each process pads its own rows; the PRM's reads are counted once,
    # as the whole-step hook's test shows)
    columns = [*training.PROCESS_COLUMNS.values(), *REWARD_COLUMNS]
    assert [{c: r[c] for c in columns} for r in _rows(two)] == \
        [{c: r[c] for c in columns} for r in _rows(one)]
    assert (two / "samples.jsonl").read_text() == (one / "samples.jsonl").read_text()


GOOD = " <think>\nStep 1: {a}+{b}={s}\n</think>\n\\boxed{{{s}}}"
BAD = " <think>\nStep 1: {a}+{b}={w}\n</think>\n\\boxed{{{w}}}"
# (a, b): 4 groups of 3 completions (right, wrong, wrong), 2 groups per process
HOOK_GROUPS = [(3, 4), (12, 9), (25, 17), (6, 8)]


def _prm_groups(tokenizer):
    """The groups (example, rollouts, rewards), their outcome advantages and completion mask
    (each group's mask right-padded to the longest)."""
    groups = []
    for a, b in HOOK_GROUPS:
        example = {"problem": f"Compute {a}+{b}", "answer": str(a + b)}
        texts = [GOOD.format(a=a, b=b, s=a + b), BAD.format(a=a, b=b, w=a + b + 1),
                 BAD.format(a=a, b=b, w=a + b + 10)]
        ro = rollouts_from_texts(tokenizer, render_prompt(example["problem"]), texts)
        groups.append((example, ro, None))
    outcomes = torch.tensor([[1.0, -0.5, -0.5]] * len(groups))
    T = max(ro.completion_mask.shape[1] for _, ro, _ in groups)
    mask = torch.cat([torch.nn.functional.pad(ro.completion_mask, (0, T - ro.completion_mask
                                                                   .shape[1]))
                      for _, ro, _ in groups])
    return groups, outcomes, mask


def _prm_hook(prm_dir):
    """A process hook scored by an online PRM read from `prm_dir` (the same on every process)."""
    prm, tokenizer = load_prm(prm_dir)
    return ProcessAdvantageFn(tokenizer, OnlinePRMStepScorer(prm, tokenizer, lr=1e-2),
                              variant="progress")


def _whole_step_worker(rank_, init_file, out_dir, prm_dir):
    """One of two Gloo processes: its share of the groups through `systems.whole_step_hook`,
    and, for contrast, through the plain hook (each process learning from its own groups)."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_,
                                         world_size=2)
    try:
        hook = _prm_hook(prm_dir)
        groups, outcomes, _ = _prm_groups(hook.tokenizer)
        start, stop = distributed.shard_range(len(groups))
        mine = groups[start:stop]
        T = max(ro.completion_mask.shape[1] for _, ro, _ in mine)
        mask = torch.cat([torch.nn.functional.pad(ro.completion_mask, (0, T - ro.completion_mask
                                                                       .shape[1]))
                          for _, ro, _ in mine])
        whole = systems.whole_step_hook(hook)
        adv = whole(mine, outcomes[start:stop], mask)
        check_states_agree({"step_scorer": hook.step_scorer})  # raises if they differ
        plain = _prm_hook(prm_dir)
        plain(mine, outcomes[start:stop], mask)
        try:
            check_states_agree({"step_scorer": plain.step_scorer})
            plain_error = None
        except RuntimeError as err:
            plain_error = str(err)
        torch.save({"wrapped": isinstance(whole, systems.WholeStepHook), "adv": adv,
                    "infos": [info["step_rewards"] for info in whole.last_infos],
                    "groups": [g[0] for g in whole.last_groups],
                    "cost": whole.step_scorer is not None,
                    "state": state_to_flat(hook.step_scorer.state_dict())[0],
                    "plain": state_to_flat(plain.step_scorer.state_dict())[0],
                    "plain_error": plain_error}, f"{out_dir}/{rank_}.pt")
    finally:
        distributed.shutdown_distributed()


def test_the_whole_step_hook_makes_every_process_learn_the_one_process_prm(tmp_path, prm_dir):
    torch.multiprocessing.spawn(_whole_step_worker,
                                args=(str(tmp_path / "init"), str(tmp_path), str(prm_dir)),
                                nprocs=2)
    one = _prm_hook(prm_dir)  # one process: every group, in order
    groups, outcomes, mask = _prm_groups(one.tokenizer)
    adv = one(groups, outcomes, mask)
    want = state_to_flat(one.step_scorer.state_dict())[0]
    got = [torch.load(tmp_path / f"{r}.pt") for r in (0, 1)]
    G = 3
    for r, part in enumerate(got):
        assert part["wrapped"] and part["cost"] == (r == 0)  # the PRM's tokens counted once
        assert part["state"].keys() == want.keys()
        assert all(torch.equal(part["state"][k], want[k]) for k in want)
        rows = slice(2 * r * G, 2 * (r + 1) * G)
        T = part["adv"].shape[1]
        assert torch.equal(part["adv"], adv[rows, :T]) and not adv[rows, T:].any()
        assert part["infos"] == [info["step_rewards"] for info in one.last_infos[2 * r:2 * r + 2]]
        assert part["groups"] == [g[0] for g in groups[2 * r:2 * r + 2]]
    # without the whole step each process's PRM learns from its own groups: they differ, and
    # the run's end-of-run check says so
    assert any(not torch.equal(got[0]["plain"][k], got[1]["plain"][k]) for k in want)
    assert all("the step_scorer's state differs between ranks" in p["plain_error"] for p in got)


# ----------------------------------------------------------------------------------------------
# The pieces, in one process
# ----------------------------------------------------------------------------------------------

def test_generator_list_draws_each_block_from_its_own_generator():
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    u = row_uniforms(6, gens, "cpu")  # rows 0-2 from seed 1, rows 3-5 from seed 2
    assert u.shape == (6, 1)
    for i, s in enumerate((1, 2)):
        assert torch.equal(u[3 * i:3 * i + 3], torch.rand(3, 1, generator=torch.Generator()
                                                          .manual_seed(s)))
    one = row_uniforms(4, torch.Generator().manual_seed(1), "cpu")  # the single-generator path
    assert torch.equal(one, torch.rand(4, 1, generator=torch.Generator().manual_seed(1)))
    with pytest.raises(ValueError, match="2 generators cannot share 5 rows"):
        row_uniforms(5, gens, "cpu")
    logits = torch.randn(4, 7)
    a = sample_next_token(logits, 1.0, generator=[torch.Generator().manual_seed(s)
                                                  for s in (3, 4)])
    b = sample_next_token(logits[2:], 1.0, generator=[torch.Generator().manual_seed(4)])
    assert torch.equal(a[2:], b)  # rows 2-3 do not depend on rows 0-1


def test_a_prompts_rollouts_do_not_depend_on_the_other_prompts(tiny_dir, even_reward):
    model, tok = load_pretrained(tiny_dir, device="cpu")
    examples = [{"problem": f"{a}+{b}", "answer": str(a + b)} for a, b in
                [(2, 3), (41, 5), (6, 7), (8, 999)]]  # prompts of different lengths

    def rollouts(idx, scale="group"):
        return collect_rollouts(model, tok, [examples[i] for i in idx], "cpu", even_reward,
                                num_rollouts=4, max_new_tokens=6, temperature=1.0, top_p=1.0,
                                generator=rollout_generators("cpu", 5, 2, idx),
                                scale_rewards=scale)

    whole = rollouts([0, 1, 2, 3])
    halves = [rollouts([0, 1]), rollouts([2, 3])]
    assert [s["text"] for s in whole.samples] == [s["text"] for h in halves
                                                  for s in h.samples]
    assert len({s["text"] for s in whole.samples}) > 4  # really sampled
    # batch-std scaling over both halves (gather_groups): the advantages of the whole batch
    ref = rollouts([0, 1, 2, 3], "batch")
    other = rollouts([2, 3], "batch").rewards
    faked = collect_rollouts(
        model, tok, examples[:2], "cpu", even_reward, num_rollouts=4, max_new_tokens=6,
        temperature=1.0, top_p=1.0, generator=rollout_generators("cpu", 5, 2, [0, 1]),
        scale_rewards="batch", gather_groups=lambda x: (torch.cat([x, other]), 0))
    torch.testing.assert_close(faked.advantages, ref.advantages[:8])
    assert not torch.allclose(rollouts([0, 1], "batch").advantages, ref.advantages[:8])


def test_dynamic_sampling_keeps_the_first_groups_in_prompt_order(monkeypatch):
    # 2 rounds, 2 processes; kept groups per (round, process): [[1, 2], [2, 1]], budget 4:
    # round 0 gives 3 (process 0: 1, process 1: 2), round 1 one more, from process 0.
    G = 2

    def batch(groups):
        ids = torch.arange(groups * G * 3).reshape(groups * G, 3)
        mask = torch.ones(groups * G, 2, dtype=torch.bool)
        return RolloutBatch(ids, None, 1, mask, torch.zeros(groups * G), torch.zeros(groups, G))

    kept = [[1, 2], [2, 1]]
    for me, expect in ((0, 2 * G), (1, 2 * G)):
        monkeypatch.setattr(systems, "rank", lambda me=me: me)
        mine = [batch(kept[0][me]), batch(kept[1][me])]
        got = systems._first_groups(mine, kept, 4, G, 0)
        assert got.size == expect
        if me == 0:  # its round-0 group and the first of its round-1 groups
            assert torch.equal(got.input_ids, torch.cat([mine[0].input_ids,
                                                         mine[1].input_ids[:G]]))


def test_shards_cover_everything_once_in_order():
    for n in (4, 5, 7):
        for world in (1, 2, 3):
            parts = [distributed.shard(list(range(n)), r, world) for r in range(world)]
            assert [x for p in parts for x in p] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert distributed.world_size() == 1 and distributed.is_main()  # no group: one process
    assert distributed.gather_lists([1, 2]) == [1, 2] and distributed.all_reduce_sum([3]) == [3]


class _Head(torch.nn.Module):
    """The smallest model the DDP view serves: forward_hidden (identity) and an lm_head."""

    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(2, 1)

    def forward_hidden(self, x):
        return x

    def forward(self, x):
        return self.lm_head(x)


def test_one_process_trains_the_model_itself_without_ddp():
    model = _Head()
    assert distributed.world_size() == 1 and distributed.data_parallel(model) is model
    assert "_replicated" not in model.__dict__


def _fail_on_main():
    raise FileExistsError("runs/x already holds a run")


def _helpers_worker(rank_, init_file, out_dir):
    """One of two Gloo processes exercising the helpers; saves what it saw to out_dir/<rank>.pt."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_,
                                         world_size=2)
    try:
        torch.manual_seed(0)  # the same head on both ranks
        model = _Head()
        net = distributed.data_parallel(model)
        if rank_ == 0:  # two micro-batches: the first accumulates only, the second sums
            net.sync_next_backward(False)
            net(torch.tensor([[1.0, 2.0]])).sum().backward()
            net.sync_next_backward(True)
            net(torch.tensor([[3.0, 4.0]])).sum().backward()
        else:  # one, through forward_hidden and the head, as the GRPO loss runs it
            net.lm_head(net.forward_hidden(torch.tensor([[5.0, 6.0]]))).sum().backward()
        groups, start = distributed.gather_groups(torch.full((rank_ + 1, 2), float(rank_)))
        try:
            distributed.run_on_main(_fail_on_main)
            error = None
        except FileExistsError as err:
            error = str(err)
        torch.save({"weight": model.lm_head.weight.grad, "bias": model.lm_head.bias.grad,
                    "wrapped": isinstance(net, distributed.Replicated),
                    "state": list(model.state_dict()),
                    "copy_unwrapped": vars(copy.deepcopy(model)).get("_replicated") is None,
                    "groups": groups, "start": start, "error": error,
                    "any": distributed.any_rank(rank_ == 1),
                    "all": distributed.all_ranks(rank_ == 1),
                    "sum": distributed.all_reduce_sum([rank_ + 1, 0.5]),
                    "gathered": distributed.gather_lists(distributed.shard(list(range(5))))},
                   f"{out_dir}/{rank_}.pt")
    finally:  # meets the other process first: none tears down Gloo while the other talks
        distributed.shutdown_distributed()


def test_helpers_in_a_group_of_two_processes(tmp_path):
    torch.multiprocessing.spawn(_helpers_worker, args=(str(tmp_path / "init"), str(tmp_path)),
                                nprocs=2)
    for r in (0, 1):
        got = torch.load(tmp_path / f"{r}.pt")
        # d(sum of w.x + b)/dw = the rows' sum, summed (not averaged) over ranks: 1+3+5, 2+4+6
        assert torch.equal(got["weight"], torch.tensor([[9.0, 12.0]]))
        assert torch.equal(got["bias"], torch.tensor([3.0]))  # three rows
        assert got["wrapped"] and got["state"] == ["lm_head.weight", "lm_head.bias"]
        assert got["copy_unwrapped"]  # the KL reference, a deep copy, is a plain model
        assert torch.equal(got["groups"], torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
        assert got["start"] == r
        assert got["error"] == "runs/x already holds a run"  # rank 0's error, on both ranks
        assert (got["any"], got["all"]) == (True, False)
        assert got["sum"] == [3.0, 1.0] and got["gathered"] == [0, 1, 2, 3, 4]


def test_a_deferred_interrupt_is_handed_on_to_the_recorder():
    with record_interrupts() as flag:
        with defer_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            assert not flag.received  # still deferred
        assert flag.received  # handed on, not raised
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with record_interrupts(enabled=False) as flag, pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # one process: Ctrl-C raises at once


@pytest.mark.parametrize("name", ["ch07_compare", "ch08_process_vs_outcome", "ch08_train_prm",
                                  "ch09_distill_vs_rl"])
def test_experiment_scripts_refuse_several_processes(name, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc-per-node 2 sets it
    spec = importlib.util.spec_from_file_location(name, ROOT / "chapters" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit, match=f"{name}.py runs in one process only"):
        script.main(["--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
