"""Sharded data parallelism (PyTorch's FSDP2, `fully_shard`) for the GRPO loop and chapter 9's
distillation: each of N processes keeps 1/N of the trainable weights, their gradients and their
AdamW state, so a model whose optimizer state does not fit one GPU still trains (`--fsdp` under
torchrun). Distillation (distillation_training.py, `sft.sft_step`) uses the same helpers: the
replica for evaluation, `dummy_backward` for a process without traces in a batch, the sharded
checkpoints.

How the loop (training.py) uses it, one helper per concern:
- `shard_model`: `fully_shard` on every decoder block, then on the root (embedding, final norm,
  lm_head), and `forward_hidden` registered as a forward method, so the log-prob pass
  (`grpo.token_logprobs_and_entropy`) all-gathers the weights as `forward` does. Gradients are
  reduce-scattered as sums (divide factor 1): the loop scales each loss by the whole step's
  normalisers, so the sum over processes is the one-process gradient, where FSDP's default
  average would divide it by N once more.
- `load_model_sharded`: the sharded start. The model is built on the meta device, sharded,
  and filled by a broadcast from rank 0, so no other process ever holds it whole.
- `shard_with_replica` / `refresh_replica`: a plain, unsharded copy of the policy for sampling,
  scoring and evaluation. Decoding calls the model a different number of times on each process
  (each stops when its own rows finish); a sharded model all-gathers inside every forward, so
  the processes would wait for each other forever. The replica is refreshed (one all-gather
  per tensor, the same calls on every process) once after every update, and every process then
  decodes on its own. It costs one full copy of the weights in the compute dtype: the memory
  of `unshard()` for the rollout phase, kept through the update.
- `dummy_backward`: a zero-weighted forward/backward through every sharded block. The update
  runs the same number of micro-batches on every process (FSDP's collectives must pair up); a
  process with fewer rows (or none) makes up the difference with these, which add nothing.
- `save_sharded` / `load_sharded`: model and AdamW shards through `torch.distributed.checkpoint`
  (DCP), which re-shards on load, so a run resumes with any number of processes.
- `full_state`: the whole weights, gathered on every process. final/ and every checkpoint get
  their Hugging Face weights from the replica, which holds exactly these after each update.
- `local_numel` / `optimizer_state_bytes` measure the shards (what memory.py's table
  predicts for a Qwen3 config: docs/data_parallel.md).

FSDP2 is described in the PyTorch docs ("torch.distributed.fsdp.fully_shard"); the sharding of
weights, gradients and optimizer state is ZeRO stage 3 (Rajbhandari et al., arXiv:1910.02054).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from .distributed import run_on_main
from .qwen3 import Qwen3Config, Qwen3Model
from .tokenizer import Qwen3Tokenizer
from .weights import (
    checkpoint_index,
    has_weights,
    load_hf_state_dict,
    load_pretrained,
    resolve_model_dir,
)

# FSDP2 and its setters arrived over several torch releases. Only `--fsdp` needs them: on a torch
# without them every import here still works (the names below are then None), plain and
# replicated training run as before, and `--fsdp` is refused with `fsdp2_problem`'s reason.
try:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import (
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )
    from torch.distributed.tensor import DTensor
    _IMPORT_ERROR = None
except ImportError as err:  # torch without FSDP2 (or without torch.distributed)
    dcp = get_state_dict = set_state_dict = set_model_state_dict = StateDictOptions = None
    fully_shard = register_fsdp_forward_method = None
    FSDPModule = MixedPrecisionPolicy = DTensor = None
    _IMPORT_ERROR = err

# The FSDPModule setters `shard_model` needs (gradients reduced as plain sums).
FSDP2_SETTERS = ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms")
# The setter `shard_model` calls where torch has it (torch 2.11 does not): a parameter one process
# did not use contributes zeros instead of skipping a collective. The package's loss paths use
# every parameter anyway (`grpo.sequence_logprob_and_entropy` builds its zero loss through the
# head, a process without rows runs `dummy_backward`), so without it sharded runs are unchanged.
UNUSED_PARAMS_SETTER = "set_reduce_scatter_unused_params"

# The sharded model and optimizer of a checkpoint (a DCP directory: one file per process plus
# .metadata); the rest of the checkpoint is checkpoints.py's (trainer_state.json, HF weights).
SHARDED_DIR = "sharded"

def fsdp2_problem() -> str | None:
    """Why this torch cannot run `--fsdp` (FSDP2 or one of its setters missing), or None."""
    if _IMPORT_ERROR is not None:
        return f"--fsdp needs FSDP2, which torch {torch.__version__} lacks ({_IMPORT_ERROR})"
    missing = [name for name in FSDP2_SETTERS if not hasattr(FSDPModule, name)]
    if missing:
        return (f"--fsdp needs FSDPModule.{', '.join(missing)}, which torch {torch.__version__} "
                "lacks; install a newer torch")
    return None


def check_fsdp_run(fsdp: bool, checkpoint=None) -> None:
    """Raise ValueError (for the command line) if a run with `fsdp` cannot start: this torch
    lacks FSDP2, or the checkpoint resumed is of the other kind (sharded or not: they do not
    mix)."""
    problem = fsdp2_problem() if fsdp else None
    if problem:
        raise ValueError(problem)
    if checkpoint and is_sharded_checkpoint(checkpoint) != fsdp:
        kind = "with" if is_sharded_checkpoint(checkpoint) else "without"
        raise ValueError(f"{checkpoint} was written by a run {kind} --fsdp; resume it {kind} "
                         "--fsdp")


def mixed_precision(device) -> MixedPrecisionPolicy | None:
    """bf16 compute with fp32 gradient reduction on CUDA; None (all fp32, exact) on the CPU."""
    if torch.device(device).type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def shard_model(model, mp_policy: MixedPrecisionPolicy | None = None):
    """`fully_shard` each decoder block, then the root, in place; gradients reduced as sums.
    Returns the model (now an FSDPModule whose parameters are DTensor shards)."""
    problem = fsdp2_problem()
    if problem:
        raise RuntimeError(problem)
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in model.model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    register_fsdp_forward_method(model, "forward_hidden")  # the log-prob pass calls it
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum over processes, not the mean
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (Gloo has no PREMUL)
            if hasattr(module, UNUSED_PARAMS_SETTER):  # a safety net where torch has it
                getattr(module, UNUSED_PARAMS_SETTER)(True, recurse=False)
    return model


def is_sharded(model) -> bool:
    """Whether `model` went through `shard_model`."""
    return FSDPModule is not None and isinstance(model, FSDPModule)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor; a plain tensor as it is."""
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every process must call it); a plain
    tensor as it is."""
    return t.full_tensor() if DTensor is not None and isinstance(t, DTensor) else t


def compute_dtype(model, device) -> torch.dtype:
    """The replica's dtype: bf16 on CUDA (`mixed_precision`'s compute dtype), else the
    model's own (fp32 on the CPU: exact)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else local_tensor(
        next(model.parameters())).dtype


def empty_replica(cfg: Qwen3Config, device, dtype: torch.dtype) -> Qwen3Model:
    """A frozen Qwen3Model for sampling, built on the meta device and given uninitialised
    memory in `dtype` on `device` directly (no random init, no fp32 copy on the way);
    `refresh_replica` fills it."""
    with torch.device("meta"):
        replica = Qwen3Model(cfg).to(dtype)
    replica.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty gives each name its own tensor: tie them again
        replica.lm_head.weight = replica.model.embed_tokens.weight
    replica.requires_grad_(False)
    return replica.eval()


def shard_with_replica(model, device, dtype: torch.dtype | None = None):
    """(`model` sharded in place, its unsharded replica) for an FSDP run: sharding first frees
    the whole weights before the replica exists, so a process never holds both in full; the
    replica is built in the compute dtype directly and filled from the shards (one all-gather
    per tensor). A model already sharded (`load_model_sharded`) only gets its replica.
    dtype: the replica's (default `compute_dtype`)."""
    if not is_sharded(model):
        shard_model(model, mixed_precision(device))
    replica = empty_replica(model.cfg, device, dtype or compute_dtype(model, device))
    refresh_replica(replica, model)
    return model, replica


def load_model_sharded(model_dir, device, dtype: torch.dtype | None = None,
                       fill: bool = True):
    """A sharded Qwen3Model from a HF-layout directory, whole on no process but rank 0's reader:
    built on the meta device, sharded (`shard_model`), given memory for its shards alone, then
    filled by `set_model_state_dict(..., broadcast_from_rank0=True)`: rank 0 reads the weights a
    group of tensors at a time (`_load_groups`), each tensor is broadcast and every process
    keeps its shard. dtype: of the master weights (default fp32). fill=False: the shards are
    left unset, for `load_sharded` to fill (a sharded checkpoint holds only the config)."""
    model_dir = resolve_model_dir(model_dir)
    cfg = Qwen3Config.from_json(Path(model_dir) / "config.json")
    dtype = dtype or torch.float32
    with torch.device("meta"):
        model = Qwen3Model(cfg).to(dtype)
    shard_model(model, mixed_precision(device))
    model.to_empty(device=device)  # this process's shards only
    if not fill:
        return model.eval()
    groups = _load_groups(model)
    run_on_main(_check_holds, model_dir, [n for g in groups for n in g])  # else all raise
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    for names in groups:  # the same groups, in the same order, on every process
        full = load_hf_state_dict(model_dir, dtype=dtype, names=names) \
            if dist.get_rank() == 0 else {}
        set_model_state_dict(model, full, options=options)  # the others get their shards
        del full
    return model.eval()


# Tensors read and broadcast at a time by `load_model_sharded` (elements): rank 0 then never
# holds the whole model beside its shards, only a group of this size.
LOAD_GROUP_NUMEL = 1 << 26


def _check_holds(model_dir, names) -> None:
    """Raise ValueError if the checkpoint in `model_dir` lacks any of `names`."""
    missing = sorted(set(names) - set(checkpoint_index(model_dir)))
    if missing:
        raise ValueError(f"{model_dir} lacks {len(missing)} tensor(s) of the model: "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")


def _load_groups(model) -> list[list[str]]:
    """The model's tensor names in groups of at most LOAD_GROUP_NUMEL elements (a larger
    tensor alone); a tied lm_head is left out (it is the embedding's parameter)."""
    tied = model.cfg.tie_word_embeddings
    groups, size = [], 0
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        if not groups or size + t.numel() > LOAD_GROUP_NUMEL:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += t.numel()
    return groups


def load_for_run(name_or_path, device, dtype: torch.dtype | None, sharded: bool):
    """(model, tokenizer) for a training run: `weights.load_pretrained`, or with `sharded` (an
    FSDP run in a process group) `load_model_sharded`, so no process but rank 0 ever reads the
    whole model and none holds it twice. A sharded checkpoint without HF weights gives the
    model unfilled: the run loads its shards (`checkpoints.load_checkpoint`)."""
    if not sharded:
        return load_pretrained(name_or_path, device=device, dtype=dtype)
    model_dir = resolve_model_dir(name_or_path)
    tokenizer = Qwen3Tokenizer.from_pretrained(model_dir)
    fill = has_weights(model_dir) or not is_sharded_checkpoint(model_dir)
    return load_model_sharded(model_dir, device, dtype, fill=fill), tokenizer


@torch.no_grad()
def refresh_replica(replica, model) -> None:
    """Copy the sharded model's current weights into `replica` (every process, same order)."""
    target = dict(replica.named_parameters())
    for name, p in model.named_parameters():
        target[name].copy_(full_tensor(p.detach()))


def full_state(model) -> dict[str, torch.Tensor]:
    """{name: whole tensor on the CPU} of a sharded model, on every process (a collective)."""
    return {k: full_tensor(v.detach()).cpu() for k, v in model.state_dict().items()}


def dummy_backward(model) -> None:
    """A forward and backward pass through every sharded module whose gradient is zero: what a
    process without a micro-batch runs so the others' collectives find a partner."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=local_tensor(
        model.model.embed_tokens.weight).device)
    (model.lm_head(model.forward_hidden(ids)).sum() * 0.0).backward()


def local_numel(params) -> int:
    """Elements of `params` held by this process (its shards of DTensors)."""
    return sum(local_tensor(p).numel() for p in params)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of this process's optimizer state tensors (AdamW: exp_avg, exp_avg_sq, step)."""
    return sum(local_tensor(v).numel() * v.element_size()
               for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v))


def shard_sizes(model, optimizer) -> dict[str, int]:
    """This process's share: parameter elements and AdamW state bytes (summary.json)."""
    return {"param_elements": local_numel(model.parameters()),
            "adamw_bytes": optimizer_state_bytes(optimizer)}


# ----------------------------------------------------------------------------------------------
# Sharded checkpoints (torch.distributed.checkpoint)
# ----------------------------------------------------------------------------------------------

def save_sharded(path, model, optimizer) -> None:
    """Write every process's model and AdamW shards under `path`/sharded (a collective)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd},
             checkpoint_id=str(Path(path) / SHARDED_DIR))


def load_sharded(path, model, optimizer) -> None:
    """Load `save_sharded`'s model and AdamW state into a sharded model, whatever the number of
    processes that wrote it (DCP re-shards)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # initialises the AdamW state
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(Path(path) / SHARDED_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def is_sharded_checkpoint(path) -> bool:
    """Whether checkpoint dir `path` holds sharded (DCP) model and optimizer state."""
    return (Path(path) / SHARDED_DIR / ".metadata").is_file()
