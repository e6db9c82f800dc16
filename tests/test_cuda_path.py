"""The CUDA-only lines of the compiled decode path, proven on the CPU as far as they can be:
run under a CUDA-graph emulation (tests/graph_replay.py: outputs overwritten by the next call,
inputs not marked static copied, addresses recorded), the decode step writes only inputs marked
as fixed addresses, a training run keeps every shape's buffers and the sampler's weights at
their addresses after its warm-up (so no graph would be recorded again), refreshing the
bfloat16 sampler writes its weights in place and the compiled step reads them, the decode loop
reads the device once per CHECK_EVERY tokens, and the first-use check falls back to eager when
the compiled path disagrees with it.
"""

import json
import math
import warnings
from dataclasses import replace

import torch
from graph_replay import GraphReplay, HostSyncs, replay_decode_steps
from tolerance import max_diff
from torch._dynamo.utils import counters

from reasoning_from_scratch import (
    compile_check,
    compiled_update,
    distributed,
    fsdp,
    generation,
    training,
)
from reasoning_from_scratch.compiled_update import FixedShape
from reasoning_from_scratch.fsdp import refresh_replica
from reasoning_from_scratch.generation import generate
from reasoning_from_scratch.qwen3 import Qwen3Model, tiny_config
from reasoning_from_scratch.run_log import read_metrics
from reasoning_from_scratch.systems import sampling_replica
from reasoning_from_scratch.training import GRPOConfig, train_grpo
from reasoning_from_scratch.weights import load_pretrained

V = 24
EOS = [1, 2, 3]
TRAIN = [{"problem": p, "answer": "0"} for p in
         ("2+3", "+".join(str(i) for i in range(1, 40)), "4+5", "6+7")]  # two prompt buckets
HELD_OUT = [{"problem": "3+4", "answer": "7"}, {"problem": "5+6", "answer": "11"}]
LONG = "+".join(str(i) for i in range(1, 40))
# evaluation batches of 2 in three shapes (rows 2 and 1, two prompt buckets)
HELD_OUT_5 = [*HELD_OUT, {"problem": "1+1", "answer": "2"}, {"problem": LONG, "answer": "780"},
              {"problem": LONG + "+0", "answer": "780"}]


def _model(seed=0):
    torch.manual_seed(seed)
    return Qwen3Model(tiny_config(vocab_size=V)).eval()


def _prompts(P=5):
    ids = torch.arange(2 * P).reshape(2, P) % (V - 4) + 4
    mask = torch.ones(2, P, dtype=torch.bool)
    mask[1, :2] = False
    return ids, mask


# ----------------------------------------------------------------------------- the emulation


def test_the_emulation_does_what_a_cuda_graph_does():
    """A toy step that returns a tensor and writes an input: the output of the first call is
    overwritten by the second; a write into an input that is not static is lost and reported;
    a static input at a new address is a recording again."""
    def step(x, y):
        y.add_(1)  # writes an input
        return x * 2

    replay = GraphReplay(step)
    x, y = torch.ones(3), torch.zeros(3)
    replay.static = {id(x)}
    kept = replay(x, y)  # recorded; a caller keeps this output past the next call
    assert torch.equal(kept, torch.full((3,), 2.0))
    assert torch.equal(y, torch.zeros(3)) and replay.dynamic_writes  # the write was lost
    x.fill_(3.0)  # in place: the same address
    again = replay(x, y)
    assert replay.replays == 1 and again is kept
    assert torch.equal(kept, torch.full((3,), 6.0))  # the first output was overwritten
    moved = torch.full((3,), 4.0)
    replay.static.add(id(moved))
    replay(moved, y)  # a static input at another address
    assert replay.rerecords == 1


def test_compiled_decoding_under_graph_replay_gives_eager_tokens(monkeypatch):
    """The decode step run with a CUDA graph's semantics: eager's tokens, log-probs and
    generator state (greedy and sampled, G rows per prompt, rows padded to a power of two),
    every tensor it writes marked static, the same addresses on every call of a shape, and
    the returned tensors not overwritten by the next call."""
    model = _model()
    replay = replay_decode_steps(monkeypatch)
    kw = dict(max_new_tokens=24, temperature=0.9, top_p=0.8, top_k=12, num_return_sequences=3,
              return_logprobs=True, eos_token_id=EOS)
    outs = {}
    for compile in (False, True, True):  # the second compiled call replays
        gens = [torch.Generator().manual_seed(10 + b) for b in range(2)]
        out = generate(model, *_prompts(), generator=gens, compile=compile, **kw)
        outs.setdefault(compile, []).append((out, [g.get_state() for g in gens]))
    (eager, eager_rng), = outs[False]
    (fast, fast_rng), (again, _) = outs[True]
    # the static step attends over every slot (the empty ones masked), the eager one over the
    # filled ones: the same sums in another order, float32 rounding apart
    tol = compile_check.rounding_tolerance(float(eager.logprobs.abs().max()), None)
    for out in (fast, again):
        assert torch.equal(out.sequences, eager.sequences)
        assert torch.equal(out.completion_mask, eager.completion_mask)
        torch.testing.assert_close(out.logprobs, eager.logprobs, rtol=0, atol=tol)
    assert all(torch.equal(a, b) for a, b in zip(fast_rng, eager_rng))
    assert fast.sequences.data_ptr() != again.sequences.data_ptr()  # clones, not the buffers
    assert replay.dynamic_writes == []
    assert replay.rerecords == 0 and replay.replays > 0
    greedy = generate(model, *_prompts(), max_new_tokens=24, eos_token_id=EOS)
    assert torch.equal(generate(model, *_prompts(), max_new_tokens=24, eos_token_id=EOS,
                                compile=True).sequences, greedy.sequences)
    assert replay.dynamic_writes == [] and replay.rerecords == 0


def test_the_decode_loop_reads_the_device_once_per_check_window(monkeypatch):
    """Host syncs of `generate(compile=True)` (EOS on but never met, so every token runs):
    the prefill's few, then one "has every row finished?" per CHECK_EVERY tokens and none per
    token (the step itself, here eager under the emulation, has none: it is one graph)."""
    model = _model()
    replay_decode_steps(monkeypatch)
    ids, mask = _prompts()

    def syncs(n):
        with HostSyncs() as seen:
            generate(model, ids, mask, max_new_tokens=n, eos_token_id=[V + 5], compile=True)
        return seen.calls

    short, long = syncs(2 * generation.CHECK_EVERY), syncs(6 * generation.CHECK_EVERY)
    extra = len(long) - len(short)
    assert extra == 4, (short, long)  # 4 more windows, one check each
    assert len(short) <= 8, short  # the prefill and the first windows


# ----------------------------------------------------------------------------- the sampler


def test_refreshing_the_bf16_sampler_keeps_its_addresses_and_the_compiled_step_reads_them():
    """`systems.sampling_replica` refreshed after an update (`fsdp.refresh_replica`, as every
    step does): every parameter at its address (a CUDA graph reads its weights there), the
    compiled step's log-probs move with the weights (no stale weights baked into the graph),
    agree with eager decoding of the new weights, and no graph is made again."""
    model = _model().float()
    replica = sampling_replica(model, "cpu", torch.bfloat16)
    before = {n: p.data_ptr() for n, p in replica.named_parameters()}
    ids, mask = _prompts()
    kw = dict(max_new_tokens=8, eos_token_id=EOS, return_logprobs=True)
    first = generate(replica, ids, mask, compile=True, **kw)
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():  # an update: every weight moves
        for p in model.parameters():
            p.mul_(1.5)
    refresh_replica(replica, model)
    assert {n: p.data_ptr() for n, p in replica.named_parameters()} == before
    assert replica.lm_head.weight is replica.model.embed_tokens.weight  # still tied
    fast = generate(replica, ids, mask, compile=True, **kw)
    eager = generate(replica, ids, mask, compile=False, **kw)
    assert counters["stats"]["unique_graphs"] == graphs
    assert generation._COMPILE_FAILURES.get(replica) is None
    assert not torch.allclose(fast.logprobs, first.logprobs)  # the new weights are read
    assert torch.equal(fast.sequences, eager.sequences)
    real = fast.completion_mask
    # what bfloat16 rounding alone does to these log-probs: the float32 model's on the tokens
    P = ids.shape[1]
    with torch.no_grad():
        logits = model(fast.sequences, torch.cat([mask, real], dim=1))[:, P - 1:-1].float()
    exact = torch.log_softmax(logits, -1).gather(-1, fast.completion_ids[..., None])[..., 0]
    tol = compile_check.rounding_tolerance(
        float(exact[real].abs().max()), float((eager.logprobs - exact)[real].abs().max()))
    assert float((fast.logprobs - eager.logprobs)[real].abs().max()) <= tol


def test_refreshing_the_fsdp_replica_after_a_sharded_update_keeps_its_addresses():
    """`fsdp.shard_with_replica` (a process group of one, Gloo): after an AdamW step on the
    shards, `refresh_replica` writes the gathered weights into the replica in place: every
    replica parameter at its address (a CUDA graph of the sampler reads it there), equal to the
    sharded model's whole weights, which the step moved; the compiled step reads them."""
    distributed.init_distributed("cpu", group_of_one=True)
    try:
        model, replica = fsdp.shard_with_replica(_model().float(), "cpu", torch.float32)
        before = {n: p.data_ptr() for n, p in replica.named_parameters()}
        old = {n: p.detach().clone() for n, p in replica.named_parameters()}
        ids, mask = _prompts()
        kw = dict(max_new_tokens=8, eos_token_id=EOS, return_logprobs=True)
        first = generate(replica, ids, mask, compile=True, **kw)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model.lm_head(model.forward_hidden(ids)).logsumexp(-1).mean().backward()
        optimizer.step()
        refresh_replica(replica, model)
        whole = fsdp.full_state(model)
        assert {n: p.data_ptr() for n, p in replica.named_parameters()} == before
        for n, p in replica.named_parameters():
            assert torch.equal(p.detach(), whole[n]), n
        assert max_diff({n: whole[n] for n in old}, old) > 1e-3  # the step moved them
        fast = generate(replica, ids, mask, compile=True, **kw)
        assert not torch.allclose(fast.logprobs, first.logprobs)  # the new weights are read
        assert torch.equal(fast.sequences, generate(replica, ids, mask, **kw).sequences)
    finally:
        distributed.shutdown_distributed()


def test_a_training_run_keeps_every_decode_address_after_its_warm_up(tiny_dir, tmp_path,
                                                                     monkeypatch):
    """A compiled run (decode under the CUDA-graph emulation, a bfloat16 sampler; one prompt
    per step in two prompt buckets, evaluation batches in three shapes with another token
    budget: five decode shapes, one more than a model kept buffers for before, when every
    evaluation made some of them anew (4 times in these 4 steps: on CUDA, a graph recorded
    again each time); evaluations every 2 steps and at the end):
    every shape's buffers are made before the first step (`generation.reserve_decoding`, the
    warm-up) and none after; no graph would be recorded again after the warm-up (buffers,
    uniforms, positions and the sampler's weights keep their addresses across the updates);
    nothing the step writes is unmarked."""
    replay = replay_decode_steps(monkeypatch)
    model, tok = load_pretrained(tiny_dir, device="cpu")
    config = GRPOConfig(steps=4, prompts_per_step=1, num_rollouts=2, max_new_tokens=6,
                        eval_every=2, eval_examples=5, eval_batch_size=2,
                        eval_max_new_tokens=20, sample_every=1,
                        seed=1, output_dir=str(tmp_path / "run"), progress=False, compile=True,
                        compile_update=False, sampler_dtype="bfloat16")
    seen, shapes = {}, []

    def hook(phase, step):
        if phase in ("rollouts", "final_eval"):
            buffers = list(generation._BUFFERS.values())
            seen[(phase, step)] = (sum(b.allocations for b in buffers), replay.rerecords,
                                   len(replay.graphs))
            shapes.append(sum(len(b.shapes) for b in buffers))

    summary = train_grpo(model, tok, TRAIN, HELD_OUT_5, "cpu", config, phase_hook=hook)
    assert set(shapes) == {5}, shapes
    assert len(seen) == 5 and len(set(seen.values())) == 1, seen  # nothing made after warm-up
    assert (replay.rerecords, len(replay.graphs)) == seen[("final_eval", 4)][1:]  # nor at the end
    assert replay.replays > 0 and replay.dynamic_writes == []
    assert not summary["compile_check"]["fell_back_to_eager"]  # the compiled path ran throughout
    # (its greedy check compares the emulated step with its own code: passed by construction)
    # the same run decoded eagerly samples the same rollouts at temperature 1, token for token
    # (samples.jsonl), to the same metrics, evaluations and weights
    eager, _ = load_pretrained(tiny_dir, device="cpu")
    plain = train_grpo(eager, tok, TRAIN, HELD_OUT_5, "cpu",
                       replace(config, compile=False, output_dir=str(tmp_path / "eager")))
    runs = [tmp_path / "run", tmp_path / "eager"]
    samples = [(d / "samples.jsonl").read_text() for d in runs]
    assert samples[0].count("\n") == 4 * 2 and samples[0] == samples[1]
    timing = {"tokens_per_s", "rollout_s", "update_s", "step_time"}
    rows = [[{k: v for k, v in r.items() if k not in timing}
             for r in read_metrics(d / "metrics.csv")] for d in runs]
    assert rows[0] == rows[1]
    assert {k: v for k, v in summary.items() if k.startswith(("base_", "final_"))} == {
        k: v for k, v in plain.items() if k.startswith(("base_", "final_"))}
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), name


# ----------------------------------------------------------------------------- the check


def _broken_step(model, device):
    """A decode step whose logits are wrong (as a stale weight or an overwritten buffer would
    make them): the last token id is pushed to the top."""
    def step(static, state, r, *setting):
        logits = model.decode_static(state.token, state.real, static)
        logits = logits.clone()
        logits[:, -1] += 100.0
        generation._record(state, logits, r, *setting)
    return step


def test_the_compile_check_passes_the_compiled_path_and_catches_a_broken_one(monkeypatch):
    model = _model()
    ids, mask = _prompts()
    replay_decode_steps(monkeypatch)
    good = compile_check.check_decoding(model, ids, mask, 12, EOS)
    assert good["ok"] and good["tokens_equal"] and good["max_logit_gap"] == 0.0
    monkeypatch.setattr(generation, "_compiled_step", _broken_step)
    bad = compile_check.check_decoding(model, ids, mask, 12, EOS)
    assert not bad["ok"] and not bad["tokens_equal"] and bad["first_difference"] == [0, 1]
    assert bad["max_logit_gap"] > 100 * bad["logit_tolerance"]


def test_the_update_check_catches_compiled_blocks_that_disagree(monkeypatch):
    """check_logprobs with the compiled block replaced by the eager block (equal: passes)
    and by one whose output is off by 1e-3 of its size (fails: a float32 tolerance is ~1e-5)."""
    model = _model()
    ids = torch.randint(4, V, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :2] = 0
    completion = torch.ones(3, 7, dtype=torch.bool)
    shape = FixedShape(rows=4, prompt_cols=5, completion_cols=8)
    args = (model, ids, mask, 5, completion, shape)
    off = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731

    def eager_block(block, x, cos, sin, attn_mask):
        return block(x, cos, sin, attn_mask)

    monkeypatch.setitem(compiled_update._COMPILED_BLOCK, "block", eager_block)
    good = compile_check.check_logprobs(*args, off)
    assert good["ok"] and good["max_logprob_diff"] < good["logprob_tolerance"] < 1e-3

    def off_block(block, x, cos, sin, attn_mask):
        out = block(x, cos, sin, attn_mask)
        return out * (1 + 1e-3)

    monkeypatch.setitem(compiled_update._COMPILED_BLOCK, "block", off_block)
    bad = compile_check.check_logprobs(*args, off)
    assert not bad["ok"] and bad["max_logprob_diff"] > bad["logprob_tolerance"]
    assert math.isfinite(bad["logprob_tolerance"])


def test_a_run_whose_compiled_decoding_disagrees_goes_on_eagerly(tiny_dir, tmp_path,
                                                                 monkeypatch):
    """The forced mismatch: one warning naming the figures and --no-compile, the run trains
    to the end eagerly (the broken step is never called after the check), and config.json,
    the checkpoints and summary.json record it."""
    model, tok = load_pretrained(tiny_dir, device="cpu")
    calls = []

    def broken(model, device):
        step = _broken_step(model, device)

        def counted(*args):
            calls.append(1)
            return step(*args)
        return counted

    monkeypatch.setattr(generation, "_compiled_step", broken)
    config = GRPOConfig(steps=2, prompts_per_step=2, num_rollouts=2, max_new_tokens=6,
                        eval_every=1, eval_examples=2, eval_batch_size=2, sample_every=0,
                        seed=1, output_dir=str(tmp_path / "run"), progress=False, compile=True,
                        compile_update=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", config)
    said = [str(w.message) for w in caught if "compiled paths disagree" in str(w.message)]
    assert len(said) == 1 and "--no-compile" in said[0] and "max logit gap" in said[0]
    checked = len(calls)
    assert checked > 0
    assert summary["steps"] == 2 and len(calls) == checked  # nothing compiled after the check
    report = summary["compile_check"]
    assert report["fell_back_to_eager"] and not report["ok"]
    assert not report["decoding"]["ok"]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["compile"] is False and saved["compile_update"] is False


def test_no_check_runs_where_nothing_is_compiled(tiny_dir, tmp_path):
    """The check costs nothing where nothing compiles (the CPU default)."""
    model, tok = load_pretrained(tiny_dir, device="cpu")
    config = GRPOConfig(steps=1, prompts_per_step=2, num_rollouts=2, max_new_tokens=4,
                        eval_every=0, eval_examples=1, sample_every=0, seed=1,
                        output_dir=str(tmp_path / "run"), progress=False,
                        compile=False, compile_update=False)
    summary = train_grpo(model, tok, TRAIN, HELD_OUT, "cpu", config)
    assert "compile_check" not in summary
    assert training.compile_decoding(config.compile, "cpu") is False
