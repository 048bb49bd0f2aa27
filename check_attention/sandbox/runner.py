"""What the sandboxed child does with the user's file: import it, build the layer, run it. The
only code that touches the user's objects, in the child process only (host.py); it imports
nothing of the project and never judges: it reports what the layer returned. Requests:

    load     shut this process in to what FILE may read (host.py), import FILE, find NAME (and
             check it is the object check() was given), build the layer (or wrap the function
             as one over (q, k, v, mask): FunctionLayer), eval() it
    forward  run the layer on each input, (x,) or (q, k, v, mask), under a seed; record each
             Linear's first input and output, or backpropagate a given output gradient, or
             report which inputs the call changed in place (probes.py)
    rebuild  build it again with another head count and report the output's shape
    context  the context lengths the layer registers (block_size, square mask buffers)
    exit     return (the host then reports the child's exit)
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
import traceback

import torch
import torch.nn as nn

try:  # the host imports this folder's files as top-level modules (host.py)
    from course import adapter_factory, adapter_kind, adapter_words
except ImportError:
    from check_attention.sandbox.course import adapter_factory, adapter_kind, adapter_words

# The spellings a constructor's parameters go by, for each size the checker builds with.
D_MODEL = {"d_model", "n_embd", "n_embed", "embed_dim", "embedding_dim", "emb_dim", "embed_size",
           "emb_size", "hidden_size", "hidden_dim", "dim", "d", "model_dim", "d_in", "in_dim",
           "input_dim", "width", "n_state", "nx", "d_hidden", "n_embedding", "num_hiddens"}
N_HEAD = {"n_head", "n_heads", "num_heads", "nhead", "nheads", "heads", "num_attention_heads",
          "h", "n_attention_heads", "head_count", "num_head", "attention_heads"}
HEAD_SIZE = {"head_size", "head_dim", "d_k", "d_head", "dim_head", "d_kv", "attention_head_size",
             "kv_channels", "hs"}
BLOCK = {"block_size", "context_length", "context_len", "context_size", "context_window",
         "max_seq_len", "max_seq_length", "seq_len", "max_len", "max_length", "n_ctx",
         "n_positions", "max_position_embeddings", "ctx_len", "sequence_length", "T",
         "max_context_length"}
DROPOUT = {"dropout", "p", "attn_pdrop", "resid_pdrop", "dropout_p", "attn_dropout",
           "attention_dropout", "resid_dropout", "dropout_rate", "drop", "attn_drop",
           "proj_drop", "pdrop", "dropout_prob", "attention_probs_dropout_prob", "embd_pdrop"}
TRUE = {"bias", "qkv_bias", "use_bias", "causal", "is_causal", "masked"}
# A modern layer's sizes (the checker reads what the layer did with them from its weights): the
# key/value heads, rotary theta, norm eps
KV_HEADS = {"n_kv_heads", "n_kv_head", "num_kv_heads", "num_key_value_heads", "kv_heads",
            "n_kv", "num_kv", "n_kv_groups", "num_query_groups", "n_query_groups", "n_groups",
            "num_groups"}
THETA = {"rope_theta", "theta", "rope_base", "rotary_base", "base"}
WINDOW = {"window", "window_size", "sliding_window", "attention_window", "attn_window"}
EPS = {"eps", "norm_eps", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"}
CONFIG = {"config", "cfg", "args", "params", "hparams", "conf", "model_config", "configs", "c",
          "opt", "options", "hp"}
QKV = ({"q", "query", "queries", "xq"}, {"k", "key", "keys", "xk"}, {"v", "value", "values", "xv"})


class SubmissionError(Exception):
    """The file or the object cannot be used (one sentence; the checker exits 2). Not the
    project's safeio.cli.UserError: this file runs in the sandboxed child and imports nothing of
    the project."""


def describe(exc: BaseException, file: str) -> str:
    """`TypeError: message (file.py, line 12)`: the exception and the user's line it came from."""
    where = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if os.path.abspath(frame.filename) == file:
            where = f" ({os.path.basename(file)}, line {frame.lineno})"
            break
    if isinstance(exc, SyntaxError) and exc.lineno:
        where = f" ({os.path.basename(file)}, line {exc.lineno})"
        return f"SyntaxError: {exc.msg}{where}"
    message = " ".join(str(exc).split())
    if len(message) > 300:
        message = message[:297] + "..."
    return f"{type(exc).__name__}: {message}{where}" if message else type(exc).__name__ + where


class LayerConfig:
    """The `config` a nanoGPT / minGPT style constructor reads its sizes from. Records what was
    read, so the report can say how the layer was built."""

    def __init__(self, sizes: dict):
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "read", {})

    def _value(self, name: str):
        found = next((value for names, value, *_ in offered(self._sizes) if name in names), None)
        if found is None:
            raise AttributeError(
                f"the layer reads config.{name}, which the checker does not know (it offers the "
                f"width, head count, head size, context length, dropout, bias, key/value "
                f"heads, rotary theta and norm eps); write a zero-argument factory in the file "
                f"and check that instead")
        return found

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = self._value(name)
        self.read[name] = value
        return value

    __getitem__ = __getattr__

    def get(self, name, default=None):
        try:
            return getattr(self, name)
        except AttributeError:
            return default

    def __contains__(self, name):
        return self.get(name) is not None

    def __setattr__(self, name, value):
        self._sizes[name] = value


def offered(s: dict) -> tuple:
    """(names, value, the size it consumes, passed even where the parameter has a default) for
    each size the checker offers a constructor: the key/value heads are half the query heads (2
    for 4, so that a grouped layer is built grouped; as many when n_head is odd)."""
    h = s["n_head"]
    return ((D_MODEL, s["d_model"], "d_model", True), (N_HEAD, h, "n_head", True),
            (HEAD_SIZE, s["d_model"] // h, "n_head", True), (BLOCK, s["block_size"], None, True),
            (KV_HEADS, h // 2 if h % 2 == 0 else h, None, False), (THETA, 10000.0, None, False),
            (EPS, 1e-6, None, False), (DROPOUT, 0.0, None, False), (TRUE, True, None, False))


def bind(fn, sizes: dict) -> tuple[list, dict, str, set]:
    """Arguments for fn built from `sizes`, by parameter name. Returns (args, kwargs, how the call
    reads, which sizes it consumed). Raises SubmissionError for a required parameter we cannot
    fill."""
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        params = None
    d, h = sizes["d_model"], sizes["n_head"]
    if params is None:
        return [d, h], {}, f"{name}({d}, {h})", {"d_model", "n_head"}
    required = [p for p in params if p.default is p.empty]
    known = D_MODEL | N_HEAD | HEAD_SIZE | BLOCK | DROPOUT | TRUE | CONFIG | KV_HEADS | THETA | EPS
    if len(required) == 2 and not any(p.name in known for p in required):
        return [d, h], {}, f"{name}({d}, {h})", {"d_model", "n_head"}  # Name(d_model, n_head)
    kwargs, consumed, config = {}, set(), None
    for p in params:
        names, value, size, always = next((e for e in offered(sizes) if p.name in e[0]),
                                          (None, None, None, False))
        if names is not None and (always or p.default is p.empty):
            kwargs[p.name] = value
            consumed |= {size} - {None}
        elif p.default is not p.empty:
            continue  # its own default (dropout is off in eval mode anyway)
        elif p.name in CONFIG and config is None:
            config = kwargs[p.name] = LayerConfig(dict(sizes))
            consumed |= {"d_model", "n_head"}
        else:
            raise SubmissionError(
                f"cannot build {name}: its parameter {p.name!r} is none the checker knows (it "
                f"passes the width as d_model / n_embd / embed_dim ..., the head count as "
                f"n_head / num_heads ..., or a config); write a zero-argument factory in the "
                f"file (def make(): return {name}(...)) and check FILE.py:make")
    how = ", ".join(k if v is config else f"{k}={v!r}" for k, v in kwargs.items())
    return [], kwargs, f"{name}({how})", consumed


def is_scaled_dot_product(fn) -> bool:
    """f(q, k, v, ...) with at least three required parameters."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(positional) < 3:
        return False
    names = [p.name.lower() for p in positional[:3]]
    if all(n in group for n, group in zip(names, QKV)):
        return True
    return len(required) >= 3 and not any(p.name in D_MODEL | N_HEAD | CONFIG for p in required)


def linear_like(module: nn.Module) -> bool:
    """A module holding one 2-D weight (and maybe a bias) of its own: nn.Linear, GPT-2's Conv1D,
    a course's hand-written Linear."""
    own = dict(module.named_parameters(recurse=False))
    weight = own.get("weight")
    return (weight is not None and weight.dim() == 2 and weight.is_floating_point()
            and set(own) <= {"weight", "bias"})


class FunctionLayer(nn.Module):
    """A scaled dot-product function as a layer over (q, k, v, mask), so that the checker calls
    a function as it calls a layer (a function without a mask parameter gets q, k, v)."""

    def __init__(self, fn, takes_mask: bool):
        super().__init__()
        self.fn, self.takes_mask = fn, takes_mask

    def forward(self, q, k, v, mask):
        return self.fn(q, k, v, mask) if self.takes_mask else self.fn(q, k, v)


class Session:
    """The child's state: the user's module, the object found in it, the built layer."""

    def __init__(self, user_cwd: str, shut_in=None):
        self.user_cwd, self.file, self.obj, self.layer = user_cwd, None, None, None
        self.shut_in = shut_in  # host.py's: confine this process to what the file may read
        self.sizes, self.how, self.device, self.dtype = {}, "", "cpu", None
        self.captures: dict = {}
        self.function = False

    # -- load

    def load(self, req: dict) -> dict:
        self.file = os.path.abspath(req["file"])
        self.sizes = {"d_model": req["d_model"], "n_head": req["n_head"],
                      "block_size": req["block_size"]}
        self.device, self.dtype = req["device"], req["dtype"]
        if self.shut_in is not None:  # before any of the file runs
            self.shut_in(os.path.dirname(self.file))
        sys.path[:0] = [os.path.dirname(self.file), self.user_cwd]  # as `python -m` from there
        sys.dont_write_bytecode = True
        torch.manual_seed(req["seed"])  # the layer's initial weights, like the probes: seeded
        stem = os.path.splitext(os.path.basename(self.file))[0]
        module_name = stem if stem.isidentifier() and stem not in sys.modules else "user_attention"
        try:
            spec = importlib.util.spec_from_file_location(module_name, self.file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        except BaseException as exc:
            raise SubmissionError(f"importing {os.path.basename(self.file)} failed: "
                                  f"{describe(exc, self.file)}") from None
        name = req["name"]
        if not hasattr(module, name):
            found = sorted(n for n, v in vars(module).items() if not n.startswith("_") and (
                (isinstance(v, type) and issubclass(v, nn.Module)) or inspect.isfunction(v))
                and getattr(v, "__module__", None) == module_name)
            raise SubmissionError(f"{os.path.basename(self.file)} has no {name!r}"
                                  + (f" (it defines {', '.join(found)})" if found else ""))
        self.obj = obj = getattr(module, name)
        if req.get("fingerprint") not in (None, fingerprint(obj)):
            raise SubmissionError(
                f"{os.path.basename(self.file)}'s {name}, imported afresh here, is not the object "
                f"given to check(): the file binds that name to another one when imported again "
                f"(a choice made at import time, by the machine or the environment?); check the "
                f"object it always binds, or give 'file.py:{name}'")
        if isinstance(obj, nn.Module):
            self.layer, self.how, consumed = self._prepare(obj), f"{name} (an instance)", set()
        elif isinstance(obj, type) and not issubclass(obj, nn.Module):
            raise SubmissionError(f"{name} is a class but not a torch.nn.Module")
        elif not isinstance(obj, type) and callable(obj) and adapter_kind(obj):
            # a course's adapter (course.py): built as a layer holding weights the checker made
            kind = adapter_kind(obj)
            self.obj = adapter_factory(obj, kind)
            self.layer, _, consumed = self._build(self.obj, self.sizes)
            self.how = adapter_words(obj, kind, self.sizes["d_model"], self.sizes["n_head"])
        elif not isinstance(obj, type) and callable(obj) and is_scaled_dot_product(obj):
            params = inspect.signature(obj).parameters
            takes_mask = len(params) >= 4 or any(
                p.kind is p.VAR_POSITIONAL for p in params.values())
            self.layer, self.function = FunctionLayer(obj, takes_mask), True
            return {"kind": "function", "how": f"{name}({', '.join(params)})",
                    "takes_mask": takes_mask}
        elif callable(obj):
            self.layer, self.how, consumed = self._build(obj, self.sizes)
        else:
            raise SubmissionError(f"{name} is an object of type {type(obj).__name__}, not an "
                                  f"nn.Module class, a factory or a function f(q, k, v, mask)")
        return self._describe_layer(consumed)

    def _build(self, obj, sizes: dict):
        args, kwargs, how, consumed = bind(obj, sizes)
        try:
            layer = obj(*args, **kwargs)
        except SubmissionError:
            raise
        except BaseException as exc:
            raise SubmissionError(f"building {how} failed: {describe(exc, self.file)}") from None
        config = next((v for v in kwargs.values() if isinstance(v, LayerConfig)), None)
        if config is not None and config.read:
            how += " with " + ", ".join(f"config.{k}={v!r}" for k, v in config.read.items())
        if not isinstance(layer, nn.Module):
            raise SubmissionError(f"{how} returned a {type(layer).__name__}, not an nn.Module")
        return self._prepare(layer), how, consumed

    def _prepare(self, layer: nn.Module) -> nn.Module:
        try:
            if self.dtype is not None:
                layer = layer.to(getattr(torch, self.dtype))
            layer = layer.to(self.device)
        except BaseException as exc:
            where = self.device + (f" as {self.dtype}" if self.dtype else "")
            raise SubmissionError(f"moving the layer to {where} failed: "
                                  f"{describe(exc, self.file)}") from None
        layer.eval()  # dropout off: the comparisons need the deterministic layer
        return layer

    def _describe_layer(self, consumed: set) -> dict:
        layer = self.layer
        params = dict(layer.named_parameters())
        floating = [p for p in params.values() if p.is_floating_point()]
        dtype = floating[0].dtype if floating else torch.float32
        linears = [{"name": n, "cls": type(m).__name__} for n, m in layer.named_modules()
                   if linear_like(m)]
        attrs = {k: v for k, v in vars(layer).items() if not k.startswith("_")
                 and isinstance(v, (int, float)) and not isinstance(v, bool)}
        sizes = {size: next((v for k, v in attrs.items() if k in names and isinstance(v, int)
                             and v > 0), None)  # as the layer keeps them: width, heads, window
                 for size, names in (("d_model", D_MODEL), ("n_head", N_HEAD), ("window", WINDOW))}
        self.captures = {}
        for entry in linears:
            module = layer.get_submodule(entry["name"]) if entry["name"] else layer
            module.register_forward_hook(self._hook(entry["name"]))
        dropouts = sum(isinstance(m, nn.Dropout) for m in layer.modules())
        # norms (QK-norm reads their kind and eps) and small 1-D buffers (a rotary inv_freq)
        norms = [{"name": n, "cls": type(m).__name__, "eps": getattr(m, "eps", None)}
                 for n, m in layer.named_modules() if "norm" in type(m).__name__.lower()]
        buffers = {n: b.detach().cpu() for n, b in layer.named_buffers()
                   if b.dim() == 1 and b.is_floating_point() and b.numel() <= 4096}
        return {"kind": "module", "how": self.how, "consumed": sorted(consumed),
                "dtype": str(dtype).replace("torch.", ""), "device": self.device,
                "params": {n: p.detach().cpu() for n, p in params.items()},
                "linears": linears, "attrs": attrs, "dropouts": dropouts,
                "norms": norms, "buffers": buffers, **sizes}

    def _hook(self, name: str):
        def hook(module, inputs, output):
            record = self.captures.get(name)
            if record is None:
                return
            record["calls"] += 1
            if record["calls"] == 1 and inputs and isinstance(inputs[0], torch.Tensor) \
                    and isinstance(output, torch.Tensor):
                record["input"], record["output"] = inputs[0].detach().cpu(), output.detach().cpu()
        return hook

    # -- running the layer

    def _run(self, layer, inp, seed: int, g=None):
        """The layer on one input under a seed: (its output; the inputs the call changed in
        place; with an output gradient g, the inputs' and parameters' gradients)."""
        names, who = (["q", "k", "v", "mask"], "it") if self.function else (["x"], "forward")
        dtype = getattr(torch, self.dtype or "float32") if self.function else next_dtype(layer)
        given = [t.to(self.device, dtype if t.is_floating_point() else t.dtype) for t in inp]
        if g is not None:
            given = [t.requires_grad_() if n != "mask" else t for n, t in zip(names, given)]
        args = [t.clone() for t in given]  # what the call may write into; `given` stays as sent
        params = [(n, p) for n, p in layer.named_parameters()
                  if p.requires_grad and p.is_floating_point()]
        torch.manual_seed(seed)
        with torch.set_grad_enabled(g is not None):
            out = layer(*args)
            out = out[0] if isinstance(out, (tuple, list)) and out else out
            if not isinstance(out, torch.Tensor):
                raise SubmissionError(f"{who} returned a {type(out).__name__}, not a tensor"
                                      + ("" if self.function else
                                         " or a tuple whose first element is one"))
            if g is not None:
                out.backward(g.to(out.device, out.dtype))
        if g is None:
            return plain(out, who), [n for n, a, t in zip(names, args, given)
                                     if not torch.equal(a, t)], None
        grad = {n: None if t.grad is None else plain(t.grad, "backward")
                for n, t in zip(names, given) if n != "mask"}
        grad.update({"param:" + n: None if p.grad is None else plain(p.grad, "backward")
                     for n, p in params})
        return plain(out, who), [], grad

    def forward(self, req: dict) -> dict:
        """Run the layer on each input under its seed; with capture, record each Linear's first
        input and output; with a grad_output, backpropagate it and report the gradients (else
        which inputs the call changed in place)."""
        out = {"ys": [], "errors": [], "captures": [], "changed": [], "grads": []}
        names = [n for n, m in self.layer.named_modules() if linear_like(m)]
        n = len(req["xs"])
        for x, seed, capture, g in zip(req["xs"], req["seeds"], req.get("capture") or [False] * n,
                                       req.get("grad_outputs") or [None] * n):
            self.captures = {n: {"calls": 0} for n in names} if capture else {}
            try:
                answer = (*self._run(self.layer, x, seed, g), None)
            except BaseException as exc:
                answer = (None, [], None, str(exc) if isinstance(exc, SubmissionError)
                          else describe(exc, self.file))
            finally:
                for p in self.layer.parameters():
                    p.grad = None
            for key, value in zip(("ys", "changed", "grads", "errors"), answer):
                out[key].append(value)
            out["captures"].append(self.captures)
        self.captures = {}
        return out

    def rebuild(self, req: dict) -> dict:
        sizes = dict(self.sizes, n_head=req["n_head"])
        torch.manual_seed(0)
        try:
            layer, _, _ = self._build(self.obj, sizes)
            return {"shape": list(self._run(layer, req["x"], 0)[0].shape)}
        except SubmissionError as exc:
            return {"error": str(exc)}
        except BaseException as exc:
            return {"error": describe(exc, self.file)}

    def context(self, req: dict) -> dict:
        """Context lengths the layer registers: int attributes named like one (block_size, ...)
        and the size of each square buffer (a [T, T] causal mask), in any of its modules."""
        sizes = set()
        for module in self.layer.modules():
            for key, value in vars(module).items():
                if key in BLOCK and isinstance(value, int) and not isinstance(value, bool) \
                        and value > 0:
                    sizes.add(value)
            for buf in module.buffers(recurse=False):
                if buf.dim() >= 2 and buf.size(-1) == buf.size(-2) > 1:
                    sizes.add(buf.size(-1))
        return {"sizes": sorted(sizes)}


def plain(out: torch.Tensor, who: str) -> torch.Tensor:
    """The output as the checker compares it: dense and real. A sparse or quantized tensor would
    not survive the comparisons, and a complex one would lose its imaginary part unseen."""
    kind = ("sparse" if out.layout != torch.strided else "quantized" if out.is_quantized else
            "complex" if out.is_complex() else "")
    if kind:
        raise SubmissionError(f"{who} returned a {kind} tensor "
                              f"({str(out.dtype).replace('torch.', '')}, "
                              f"{str(out.layout).replace('torch.', '')}); attention outputs are "
                              f"dense real tensors")
    return out.detach().cpu()


def next_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype the layer computes in: its first floating parameter's (float32 without any)."""
    for p in layer.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def fingerprint(obj) -> str:
    """What a class or function is made of, the same in every process that imports its file: the
    code of each function it defines (bytecode, constants, names, first line; nested functions
    too), and a class's bases and plain attributes. Two definitions differ here (at the least by
    their lines), whatever their __name__ says; check() compares the object it was given with
    what the sandbox finds under its name."""
    parts = []

    def code(c) -> None:
        consts = [repr(k) if isinstance(k, (int, float, complex, str, bytes, type(None))) else
                  type(k).__name__ for k in c.co_consts]
        parts.append((c.co_qualname, c.co_firstlineno, c.co_code, c.co_names, consts))
        for k in c.co_consts:
            if inspect.iscode(k):
                code(k)

    def function(f) -> None:
        f = inspect.unwrap(getattr(f, "__func__", f))
        if hasattr(f, "__code__"):
            code(f.__code__)

    if isinstance(obj, type):
        for klass in obj.__mro__:
            parts.append(klass.__qualname__)
            if klass.__module__ != obj.__module__:
                continue  # another file's: its name says which
            for key, value in sorted(vars(klass).items()):
                if isinstance(value, property):
                    parts.append(key), [function(f) for f in (value.fget, value.fset) if f]
                elif callable(getattr(value, "__func__", value)):
                    parts.append(key), function(value)
                elif key != "__module__" and isinstance(value, (int, float, str, bool)):
                    parts.append((key, repr(value)))
    else:
        function(obj)
    return hashlib.sha256(repr(parts).encode("utf-8", "surrogatepass")).hexdigest()


def serve(proto_in: int, proto_out: int, user_cwd: str, read_frame, write_frame,
          shut_in=None) -> None:
    """Answer requests until `exit` (or the checker hangs up). shut_in(folder) confines this
    process before the file in `folder` is imported."""
    session = Session(user_cwd, shut_in)
    handlers = {"load": session.load, "forward": session.forward, "rebuild": session.rebuild,
                "context": session.context}
    while True:
        try:
            req = read_frame(proto_in)
        except EOFError:
            return
        if req.get("cmd") not in handlers:
            return
        try:
            answer = handlers[req["cmd"]](req)
        except SubmissionError as exc:
            answer = {"error": str(exc)}
        except BaseException as exc:  # the user's code raised where we did not expect it
            answer = {"error": describe(exc, session.file or "")}
        write_frame(proto_out, answer)
