"""CPU stand-ins for what a CUDA GPU does to the compiled decode path, so that the code that would
misuse it fails here: `GraphReplay` (a function run as a CUDA graph, as torch.compile's
mode="reduce-overhead" runs the decode step) and `HostSyncs` (the operations that make the host
wait for the device, which `torch.cuda.set_sync_debug_mode` reports on a GPU).

What a CUDA graph does, and the emulation of each (torch.compile's CUDA-graph trees, torch
2.x: https://pytorch.org/docs/stable/torch.compiler_cudagraph_trees.html):
- it is recorded once per input signature and replayed at the recorded addresses: a static
  input (a parameter, or a tensor marked with `torch._dynamo.mark_static_address`) found at a
  new address makes it record again (`rerecords`; each costs a recording, and past a limit
  torch stops using the graph);
- every other tensor input is copied into the graph's own placeholder before a replay, so the
  function sees a copy: what it writes into such an input is lost (`dynamic_writes`; inductor
  does not graph such a function at all);
- its outputs live in the graph's memory and the next replay writes over them: the same
  output tensors are handed back by every call (`outputs`), so a caller that keeps one past
  the next call sees it change.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from reasoning_from_scratch import generation


def _tensors_of(value) -> list[torch.Tensor]:
    """The tensors an argument holds: itself, a list's, or a buffer object's `tensors()`."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_of(v)]
    if hasattr(value, "tensors"):
        return list(value.tensors())
    return []


def _signature(args) -> tuple:
    """What a graph is recorded for: shapes and dtypes of tensors, the values of the rest."""
    out = []
    for a in args:
        if isinstance(a, torch.nn.Module):
            out.append(("module", id(a)))
        elif _tensors_of(a):
            out.append(tuple((tuple(t.shape), t.dtype) for t in _tensors_of(a)))
        else:
            out.append(a)
    return tuple(out)


class GraphReplay:
    """Run `fn(*args)` as its CUDA graph would (module docstring). `static`: ids of the
    tensors the code marked as fixed addresses (`watch_marks` fills it from the decode path's
    own marking); a module argument's parameters and buffers are static too."""

    def __init__(self, fn):
        self.fn = fn
        self.static: set[int] = set()
        self.graphs: dict = {}  # signature -> {"addresses", "placeholders", "outputs"}
        self.rerecords = 0
        self.replays = 0
        self.dynamic_writes: list[str] = []

    def watch_marks(self, monkeypatch) -> None:
        """Record the tensors `generation._mark_fixed_addresses` marks (on every device)."""
        marked = generation._mark_fixed_addresses

        def mark(tensors):
            self.static.update(id(t) for t in tensors)
            marked(tensors)

        monkeypatch.setattr(generation, "_mark_fixed_addresses", mark)

    def _static_tensors(self, args) -> list[torch.Tensor]:
        out = []
        for a in args:
            if isinstance(a, torch.nn.Module):
                out += [*a.parameters(), *a.buffers()]
            else:
                out += [t for t in _tensors_of(a) if id(t) in self.static]
        return out

    def __call__(self, *args):
        with torch._C.DisableTorchFunction():  # the emulation's own reads are not the step's
            run_args, graph, versions = self._before(args)
        out = self.fn(*run_args)
        with torch._C.DisableTorchFunction():
            return self._after(args, out, graph, versions)

    def _before(self, args):
        key = _signature(args)
        addresses = [t.data_ptr() for t in self._static_tensors(args)]
        graph = self.graphs.get(key)
        if graph is not None and graph["addresses"] != addresses:
            self.rerecords += 1
            graph = None
        if graph is None:  # record: placeholders for the inputs that are not static
            graph = self.graphs[key] = {
                "addresses": addresses, "outputs": None,
                "placeholders": {i: a.clone() for i, a in enumerate(args)
                                 if isinstance(a, torch.Tensor) and id(a) not in self.static}}
        else:
            self.replays += 1
        run_args = list(args)
        for i, holder in graph["placeholders"].items():
            holder.copy_(args[i])
            run_args[i] = holder
        versions = [(t, t._version) for a in args for t in _tensors_of(a)
                    if id(t) not in self.static]
        return run_args, graph, versions

    def _after(self, args, out, graph, versions):
        self.dynamic_writes += [f"argument of shape {tuple(t.shape)}" for t, v in versions
                                if t._version != v]
        self.dynamic_writes += [f"argument {i} (a copy under a graph)"
                                for i, holder in graph["placeholders"].items()
                                if not torch.equal(holder, args[i])]
        if out is None:
            return None
        outs = out if isinstance(out, tuple) else (out,)
        if graph["outputs"] is None:
            graph["outputs"] = tuple(o.clone() for o in outs)
        else:
            for kept, new in zip(graph["outputs"], outs):
                kept.copy_(new)
        return graph["outputs"] if isinstance(out, tuple) else graph["outputs"][0]


def replay_decode_steps(monkeypatch) -> GraphReplay:
    """`generate(compile=True)`'s decode step run through a GraphReplay instead of
    torch.compile (no compiling: the step itself, eagerly, with a graph's semantics)."""
    replay = GraphReplay(generation._static_step)
    replay.watch_marks(monkeypatch)
    monkeypatch.setattr(generation, "_compiled_step",
                        lambda model, device: lambda *args: replay(model, *args))
    return replay


# torch functions that make the host wait for the device (a tensor's value read on the host)
SYNCING = {"__bool__", "item", "__int__", "__float__", "__index__", "tolist", "nonzero",
           "equal", "allclose", "is_nonzero", "numpy", "cpu"}


class HostSyncs(TorchFunctionMode):
    """Counts the calls that would make the host wait for a GPU (`SYNCING`), by name."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCING:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))
