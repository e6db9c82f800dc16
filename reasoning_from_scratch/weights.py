"""Loading and saving Qwen3 checkpoints in the Hugging Face layout (safetensors only).

A model directory holds `config.json`, `model.safetensors` (or a sharded
`model.safetensors.index.json` + shards), `tokenizer.json` and optionally `tokenizer_config.json`
and `generation_config.json`. Tensor names are the HF `Qwen3ForCausalLM` names, which are also the
`state_dict()` keys of `Qwen3Model`, so no renaming is needed. `save_pretrained` writes the same
layout, so transformers (and vLLM) can load what this package trains. Pickled checkpoints
(`pytorch_model.bin`, `torch.save`) are never read as full pickles: unpickling can run
arbitrary code. The one exception is the book's `.pth` format (its own parameter names,
`qwen3.book_to_hf_state_dict`): `read_book_checkpoint` reads it with
`torch.load(weights_only=True)`, which rebuilds only tensors and plain containers and refuses
a file that asks to run code, and `save_book_checkpoint` writes it for the book's code.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from .device import default_dtype, get_device
from .files import atomic_path, atomic_save_safetensors, atomic_write_json, read_json
from .qwen3 import QWEN_CONFIG_06_B, Qwen3Config, Qwen3Model, hf_to_book_state_dict
from .tokenizer import Qwen3Tokenizer

PathLike = str | Path

_ASSETS = Path(__file__).resolve().parent / "assets"
BUNDLED_MODELS = {"tiny-arith": _ASSETS / "tiny-arith",
                  "tiny-arith-think": _ASSETS / "tiny-arith-think"}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "*.safetensors",
    INDEX_FILE,
]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


# --------------------------------------------------------------------------------------
# Finding a model directory
# --------------------------------------------------------------------------------------


def _download_hint(repo_id: str) -> str:
    names = ", ".join(HUB_FILES)
    return (
        f"download these files from https://huggingface.co/{repo_id} (Files and versions tab): "
        f"{names}; put them in one directory, then pass its path"
    )


def download_from_hub(repo_id: str) -> Path:
    """Download a hub repository's config, tokenizer and safetensors into the HF cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except GatedRepoError as err:
        raise RuntimeError(
            f"could not download {repo_id}: the repository is gated; accept its licence on "
            f"https://huggingface.co/{repo_id} and log in (`hf auth login`), or "
            f"{_download_hint(repo_id)}"
        ) from err
    except RepositoryNotFoundError as err:
        raise FileNotFoundError(
            f"{repo_id!r} is neither a local directory, a bundled model "
            f"({', '.join(BUNDLED_MODELS)}) nor a Hugging Face repository that exists "
            f"(https://huggingface.co/{repo_id})"
        ) from err
    except Exception as err:  # offline, DNS, proxy, timeout, HF_HUB_OFFLINE without cache, ...
        raise ConnectionError(
            f"could not download {repo_id} ({type(err).__name__}: {err}): {_download_hint(repo_id)}"
        ) from err


def resolve_model_dir(name_or_path: PathLike) -> Path:
    """Local directory -> itself; bundled name -> its asset dir; 'owner/name' -> hub download."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if name in BUNDLED_MODELS:
        bundled = BUNDLED_MODELS[name]
        if not bundled.is_dir():
            raise FileNotFoundError(
                f"bundled model {name!r} is missing at {bundled}; rebuild it with "
                "`python chapters/build_tiny_model.py` or reinstall the package"
            )
        return bundled
    if path.exists():
        raise NotADirectoryError(f"{path} is a file; pass the directory that holds config.json")
    if _REPO_ID.fullmatch(name) and not name.startswith((".", "/", "~")):
        return download_from_hub(name)
    raise FileNotFoundError(
        f"model directory {path} does not exist; pass an existing directory in Hugging Face "
        f"layout, a bundled name ({', '.join(BUNDLED_MODELS)}) or a hub repository id such as "
        "'Qwen/Qwen3-0.6B'"
    )


# --------------------------------------------------------------------------------------
# Reading safetensors checkpoints
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def open_safetensors(path: PathLike, device: str = "cpu"):
    """`safe_open` whose errors name the file and say what to do (truncated or corrupt files)."""
    try:
        handle = safe_open(str(path), framework="pt", device=device)
    except SafetensorError as err:
        raise ValueError(
            f"{path} is not a readable safetensors file ({err}): it is truncated or corrupt, "
            "e.g. from an interrupted download or copy; download or copy it again (a training "
            "checkpoint: resume from an earlier checkpoint-* of the run)"
        ) from None
    with handle as f:
        yield f


def read_safetensors(path: PathLike, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (errors name the file)."""
    with open_safetensors(path) as f:
        return {name: f.get_tensor(name).to(device) for name in f.keys()}


def non_finite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of floating-point tensors holding NaN or inf."""
    return [name for name, t in tensors.items()
            if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def has_weights(model_dir: PathLike) -> bool:
    """Whether `model_dir` holds HF-layout weights (model.safetensors or a sharded index)."""
    model_dir = Path(model_dir)
    return (model_dir / SINGLE_FILE).is_file() or (model_dir / INDEX_FILE).is_file()


def checkpoint_index(model_dir: PathLike) -> dict[str, Path]:
    """Map tensor name -> safetensors file holding it (single file or sharded index)."""
    model_dir = Path(model_dir)
    single, index = model_dir / SINGLE_FILE, model_dir / INDEX_FILE
    if single.is_file():
        with open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no 'weight_map' mapping tensor names to shard files")
        out = {}
        for shard_name in sorted(set(weight_map.values())):
            shard = model_dir / shard_name
            if not shard.is_file():
                raise FileNotFoundError(
                    f"shard {shard} listed in {index} is missing; download it from the model's "
                    "Hugging Face repository into the same directory"
                )
            with open_safetensors(shard) as f:
                present = set(f.keys())
            for name, fname in weight_map.items():
                if fname != shard_name:
                    continue
                if name not in present:
                    raise KeyError(f"tensor {name!r} listed in {index} is not in shard {shard}")
                out[name] = shard
        return out
    hint = ""
    if any(model_dir.glob("pytorch_model*.bin")) or any(model_dir.glob("*.pt")):
        hint = (
            " (only pickled .bin/.pt weights are there: they are not loaded because unpickling "
            "can run arbitrary code; convert them to safetensors)"
        )
    raise FileNotFoundError(
        f"no weights in {model_dir}: expected {single} or {index} with its shards{hint}; "
        "download them from the model's Hugging Face repository or write them with "
        "save_pretrained"
    )


def _tensor_shapes(where: dict[str, Path]) -> dict[str, tuple]:
    """Shapes from the safetensors headers, without reading the data."""
    shapes = {}
    for file in sorted(set(where.values())):
        with open_safetensors(file) as f:
            for name in f.keys():
                if where.get(name) == file:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _read_tensors(where: dict[str, Path], device, dtype) -> dict[str, torch.Tensor]:
    """Read tensors file by file, casting each right away so only one extra tensor is alive."""
    out = {}
    for file in sorted(set(where.values())):
        with open_safetensors(file) as f:
            for name in f.keys():
                if where.get(name) != file:
                    continue
                t = f.get_tensor(name)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype=dtype)
                out[name] = t.to(device)
    return out


def load_hf_state_dict(model_dir: PathLike, device="cpu", dtype=None,
                       names=None) -> dict[str, torch.Tensor]:
    """All tensors of a HF-layout checkpoint (model.safetensors or sharded index); `names`:
    only these (those the checkpoint holds)."""
    where = checkpoint_index(model_dir)
    if names is not None:
        where = {n: where[n] for n in names if n in where}
    return _read_tensors(where, device, dtype)


def _check_tensors(model: Qwen3Model, shapes: dict[str, tuple], where: dict, cfg_path: Path):
    """Raise naming tensor and file for missing, unexpected or wrongly shaped tensors."""
    tied = model.cfg.tie_word_embeddings
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if tied:
        # A tied checkpoint may or may not store lm_head.weight (a copy of the embedding); when
        # present it is ignored after its shape check, as transformers does.
        expected.pop("lm_head.weight", None)
    files = ", ".join(sorted({str(p) for p in where.values()}))
    missing = [k for k in expected if k not in shapes]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise KeyError(
            f"{len(missing)} tensor(s) missing from {files}: {shown} "
            f"(the model described by {cfg_path} needs them)"
        )
    allowed_extra = {"lm_head.weight": expected.get("model.embed_tokens.weight")} if tied else {}
    if tied and "lm_head.weight" in shapes:
        expected_lm = tuple(model.lm_head.weight.shape)
        if shapes["lm_head.weight"] != expected_lm:
            raise ValueError(
                f"tensor 'lm_head.weight' in {where['lm_head.weight']} has shape "
                f"{shapes['lm_head.weight']}, expected {expected_lm}"
            )
    unexpected = [k for k in shapes if k not in expected and k not in allowed_extra]
    if unexpected:
        shown = ", ".join(f"{k} ({where[k].name})" for k in unexpected[:5])
        raise KeyError(
            f"{len(unexpected)} unexpected tensor(s) in {files}: {shown}; they do not belong to "
            f"the Qwen3 model described by {cfg_path}"
        )
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ValueError(
                f"tensor {name!r} in {where[name]} has shape {shapes[name]}, but the model "
                f"described by {cfg_path} expects {shape}"
            )


def _as_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r} (use e.g. 'float32' or 'bfloat16')")
    return resolved


def load_model(model_dir: PathLike, device=None, dtype=None) -> Qwen3Model:
    """Build a Qwen3Model from a HF-layout directory, in eval mode, without a second copy."""
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"config.json not found at {cfg_path}: copy it from the model's Hugging Face "
            "repository (it describes the architecture), or write the directory with "
            "save_pretrained"
        )
    cfg = Qwen3Config.from_json(cfg_path)  # raises naming the file for non-Qwen3 configs
    device = torch.device(device) if device is not None else get_device()
    dtype = _as_dtype(dtype) or default_dtype(device)

    # Parameters on the meta device take no memory; load_state_dict(assign=True) then adopts the
    # loaded tensors as the parameters, so a 0.6B model is never held twice.
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    where = checkpoint_index(model_dir)
    _check_tensors(model, _tensor_shapes(where), where, cfg_path)
    if cfg.tie_word_embeddings:
        where.pop("lm_head.weight", None)
    state = _read_tensors(where, device, dtype)
    bad = non_finite_tensors(state)
    if bad:  # loading still works (to inspect the model); generating from it would not
        warnings.warn(f"{model_dir}: {len(bad)} tensor(s) hold NaN or inf values: "
                      f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}", stacklevel=2)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # one Parameter, as before
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise RuntimeError(f"not loaded from {model_dir}: {still_meta}")
    return model.eval()


def load_pretrained(
    name_or_path: PathLike, device=None, dtype=None
) -> tuple[Qwen3Model, Qwen3Tokenizer]:
    """(model, tokenizer) from a local dir, a bundled name ('tiny-arith') or a hub repo id.

    `device` defaults to get_device(), `dtype` to default_dtype(device) (bfloat16 on CUDA,
    float32 elsewhere). The model is returned in eval mode.
    """
    model_dir = resolve_model_dir(name_or_path)
    tokenizer = Qwen3Tokenizer.from_pretrained(model_dir)
    model = load_model(model_dir, device=device, dtype=dtype)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(
            f"{model_dir / 'tokenizer.json'} has {tokenizer.vocab_size} tokens but "
            f"{model_dir / 'config.json'} has vocab_size={model.cfg.vocab_size}"
        )
    return model, tokenizer


# --------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------


OPT_IN_ENV = "QWEN3_DIR"  # the notebooks' opt-in cells: a local Qwen3 checkpoint directory


class OptInModel(NamedTuple):
    """What `opt_in_qwen3` loads: the model, its tokenizer, the device and the directory."""

    model: Qwen3Model
    tokenizer: Qwen3Tokenizer
    device: torch.device
    path: Path


def opt_in_qwen3(dtype=torch.float32) -> OptInModel | None:
    """The notebooks' opt-in Qwen3 (one call per opt-in cell): loaded from the local checkpoint
    directory $QWEN3_DIR names (Hugging Face layout) onto the best device, or None after one line
    saying the cell was skipped when it is unset (notebooks/README.md)."""
    path = os.environ.get(OPT_IN_ENV)
    if not path:
        print(f"skipped: set {OPT_IN_ENV} to a local Qwen3 checkpoint directory (config.json, "
              "*.safetensors, tokenizer.json) to run this cell; see notebooks/README.md")
        return None
    device = get_device()  # a GPU when there is one
    model, tokenizer = load_pretrained(path, device=device, dtype=dtype)
    return OptInModel(model, tokenizer, device, Path(path))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _remove_stale_shards(out_dir: Path) -> None:
    """Drop an old sharded checkpoint so it cannot shadow or contradict model.safetensors."""
    index = out_dir / INDEX_FILE
    if not index.is_file():
        return
    with contextlib.suppress(ValueError, OSError):
        for shard in set(read_json(index).get("weight_map", {}).values()):
            if shard != SINGLE_FILE:
                (out_dir / shard).unlink(missing_ok=True)
    index.unlink(missing_ok=True)


def save_pretrained(model: Qwen3Model, tokenizer: Qwen3Tokenizer, out_dir: PathLike,
                    weights: bool = True) -> Path:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files.
    weights=False: all but model.safetensors (the model's description and its tokenizer, for a
    checkpoint whose weights are kept elsewhere: an FSDP run's shards)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    embed = model.model.embed_tokens.weight
    tied = cfg.tie_word_embeddings
    if weights:
        if tied and model.lm_head.weight is not embed and \
                not torch.equal(model.lm_head.weight, embed):
            raise ValueError(
                "cfg.tie_word_embeddings is True but lm_head.weight differs from "
                "model.embed_tokens.weight; re-tie them or set tie_word_embeddings=False"
            )
        tensors = {k: v for k, v in model.state_dict().items()
                   if not (tied and k == "lm_head.weight")}
        atomic_save_safetensors(tensors, out_dir / SINGLE_FILE)
        _remove_stale_shards(out_dir)

    config = cfg.to_hf_dict()
    config["torch_dtype"] = _dtype_name(embed.dtype)
    if "dtype" in config:
        config["dtype"] = config["torch_dtype"]
    if config.get("eos_token_id") is None:
        config["eos_token_id"] = tokenizer.eos_token_id
    if config.get("bos_token_id") is None:
        config["bos_token_id"] = tokenizer.bos_token_id
    atomic_write_json(out_dir / "config.json", config)

    eos = tokenizer.eos_token_ids or [config["eos_token_id"]]
    generation = {
        "bos_token_id": tokenizer.bos_token_id
        if tokenizer.bos_token_id is not None
        else config.get("bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
        "pad_token_id": tokenizer.pad_token_id,
        "transformers_version": config.get("transformers_version", "4.51.0"),
    }
    atomic_write_json(
        out_dir / "generation_config.json", {k: v for k, v in generation.items() if v is not None}
    )
    tokenizer.save(out_dir)
    return out_dir


# --------------------------------------------------------------------------------------
# The book's .pth checkpoints
# --------------------------------------------------------------------------------------


def read_book_checkpoint(path: PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a `.pth` state dict (the book's format), read without running code.

    `torch.load(weights_only=True)` only rebuilds tensors and plain containers; a pickle that
    asks for anything else (e.g. a function call) is refused with ValueError before it runs.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint not found: {path} (the book's files come from download_qwen3_small, "
            "download_qwen3_grpo_checkpoints or download_qwen3_distill_checkpoints)"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first_line = str(err).strip().splitlines()[0]
        raise ValueError(
            f"{path}: refused, not a plain tensor checkpoint: it asks to run code or build "
            f"objects that a state dict never holds ({first_line}). Nothing in it was run."
        ) from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError(f"{path}: not a state dict (a dict of name -> tensor)")
    return state


def load_book_checkpoint(path: PathLike, model: Qwen3Model | None = None) -> Qwen3Model:
    """`model` (default: a new book Qwen3-0.6B, ``QWEN_CONFIG_06_B``) with a book `.pth` loaded."""
    state = read_book_checkpoint(path)
    if model is None:
        model = Qwen3Model(QWEN_CONFIG_06_B)
    model.load_state_dict(state)  # accepts the book's names and ours
    return model


def save_book_checkpoint(model, path: PathLike) -> Path:
    """Write `model.state_dict()` as a `.pth` in the book's names, atomically.

    A Qwen3 state dict is renamed (`hf_to_book_state_dict`), any other saved as it is.
    """
    path = Path(path)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if "model.embed_tokens.weight" in state:
        state = hf_to_book_state_dict(state)
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    return path
