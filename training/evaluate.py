"""Validation loss, bits per character, attention diagnostics, and a text sample."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from data.batches import sequential_windows
from model.attention import CausalSelfAttention
from model.decoding import Decoder
from model.sampling import seeded_generator
from training.attention_maps import future_weight
from training.config import CachedEval
from training.device import float64_home
from training.runtime import World, all_sum


# The most tokens a teacher-forced decode feeds at once when it joins evaluation batches
# (`merged_batches`): the pitfall studies' 20 batches of 1,024 go as 8, 8 and 4 (most of the
# gain, docs/ablations.md), the default's 4 of 2,048 as one; a larger batch goes alone, as before.
MERGED_TOKENS = 8_192


@torch.no_grad()
def mean_loss(model, batches: list, amp, world: World = World()) -> float:
    """Mean cross-entropy (nats per token) over a fixed list of (x, y) batches.

    Under DDP each rank scores every world.size-th batch and the sums are added up, so the
    result is the same whatever the number of processes.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    home = float64_home(device)  # the device (one sync at the end), or the CPU on mps
    total, count = torch.zeros((), device=home, dtype=torch.float64), 0
    for x, y in batches[world.rank::world.size]:
        with amp:
            _, loss = model(x.to(device), y.to(device))
        total += loss.to(home).double() * y.numel()
        count += y.numel()
    model.train(was_training)
    total, count = all_sum([total.item(), float(count)], world)  # one host sync
    return total / count


# Cut points per batch, at most, at which `prefix_losses` scores a position from its prefix
# alone (docs/your_layer.md measures the cost).
PREFIX_CUTS = 2


@torch.no_grad()
def prefix_losses(model, batches: list, amp, world: World = World(),
                  cuts: int = PREFIX_CUTS) -> tuple[float, float]:
    """(own, causal) mean cross-entropy of the (x, y) batches' tokens: as the model scores each
    whole window, and from each token's prefix alone (the window cut after it), which needs
    nothing of the layer: after the cut there is nothing to see. The causal mean is the own plus
    the mean difference at cut points spread evenly over the positions, `cuts` a batch: exact for
    a causal layer (0), each position weighed alike for any other while there are as many cuts
    as positions, at (T + 1) / 2 windows' cost instead of every batch's T / 2."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    T, n = max(x.size(1) for x, _ in batches), len(batches)
    ends = torch.linspace(1, T, min(T, cuts * n)).round().long().tolist()  # [K] positions + 1
    sums = torch.zeros(2, device=float64_home(device), dtype=torch.float64)  # own, cut - own
    own_count = cut_count = 0
    for i, (x, y) in list(enumerate(batches))[world.rank::world.size]:
        x, y = x.to(device), y.to(device)  # [B, T]
        with amp:
            logits = model(x)[0]  # [B, T, V]
        own = F.cross_entropy(logits.float().transpose(1, 2), y, reduction="none")  # [B, T]
        sums[0] += own.sum().to(sums.device).double()
        own_count += y.numel()
        for end in (e for e in ends[i::n] if e <= x.size(1)):  # position end - 1, from x[:, :end]
            with amp:
                last = model(x[:, :end])[0][:, -1]  # [B, V]
            cut = F.cross_entropy(last.float(), y[:, end - 1], reduction="none")  # [B]
            sums[1] += (cut - own[:, end - 1]).sum().to(sums.device).double()
            cut_count += y.size(0)
    model.train(was_training)
    own_sum, gap_sum, own_count, cut_count = all_sum([*sums.tolist(), float(own_count),
                                                       float(cut_count)], world)
    return own_sum / own_count, own_sum / own_count + gap_sum / max(cut_count, 1)


@torch.no_grad()
def full_split_loss(model, tokens: np.ndarray, block_size: int, batch_size: int, amp,
                    world: World = World()) -> float:
    """Nats per token over every token of a split (non-overlapping windows, each token once)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    home = float64_home(device)
    total, count = torch.zeros((), device=home, dtype=torch.float64), 0
    for i, (x, y) in enumerate(sequential_windows(tokens, block_size, batch_size)):
        if i % world.size != world.rank:
            continue
        with amp:
            logits, _ = model(x.to(device))
        nll = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.to(device).reshape(-1),
                              reduction="sum")
        total += nll.to(home).double()
        count += y.numel()
    model.train(was_training)
    total, count = all_sum([total.item(), float(count)], world)  # one host sync
    return total / count


@torch.no_grad()
def cached_loss(model, batches: list, amp, world: World = World(),
                static: Optional[bool] = None) -> float:
    """Mean cross-entropy (nats per token) of the same (x, y) batches as `mean_loss`, computed
    through the generation path: the model's Decoder (model/decoding.py) fed one token at a
    time with its KV cache, teacher forced (each step is given the true token, not a sampled
    one), each step's logits predicting the next token.

    For a correct layer this is the uncached loss to rounding (tests/test_pitfalls_decoding.py):
    the cache is an optimisation. A layer that trains right but decodes wrong (a cache pitfall:
    docs/ablations.md, the second study) shows here and nowhere else. The windows must fit the
    context (block_size), as the evaluation batches do. static: the static cache (CUDA graphs),
    None = as `generate` chooses.
    """
    return decoded_losses(model, batches, amp, CachedEval.tokens, world, static)[0]


@torch.no_grad()
def decoded_losses(model, batches: list, amp, how: CachedEval = CachedEval.tokens,
                   world: World = World(), static: Optional[bool] = None,
                   merge_tokens: int = MERGED_TOKENS) -> tuple[float, float]:
    """(through the cache, by the forward pass): the mean cross-entropy of the same tokens of
    the (x, y) batches, fed `how` through the generation path, teacher forced (CachedEval), and
    scored by the forward pass as in training. For a correct layer the two agree to rounding
    whatever `how` is; a pitfall of padding, cache reuse or a windowed cache moves the first
    alone. Only the tokens the way of feeding scores count in both (the real tokens of the
    served batch's rows). Fed one token at a time, consecutive batches go through together
    (`merged_batches`, up to merge_tokens tokens; 0: one by one)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    home = float64_home(device)
    if static is None:
        static = device.type == "cuda" and model.attn_cfg.is_causal()
    totals = torch.zeros(2, device=home, dtype=torch.float64)  # (cached, forward) NLL sums
    count = 0
    mine = batches[world.rank::world.size]
    for x, y in merged_batches(mine, merge_tokens) if how == CachedEval.tokens else mine:
        x, y = x.to(device), y.to(device)  # [B, T]
        with amp:
            cached, scored = FEEDS[CachedEval(how)](model, x, static)  # [B, T, V], [B, T]
            forward = model(x)[0]
        for i, logits in enumerate((cached, forward)):
            nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
            totals[i] += (nll * scored.flatten()).sum().to(home).double()
        count += int(scored.sum())
    model.train(was_training)
    cached, forward, count = all_sum([*totals.tolist(), float(count)], world)  # one host sync
    return cached / count, forward / count


def merged_batches(batches: list, merge_tokens: int) -> list:
    """Consecutive (x, y) batches of one shape joined into batches of at most merge_tokens
    tokens (a batch already that large stays as it is).

    Why: decoding one token at a time, a batch of a few dozen short rows is a few hundred tiny
    kernels per token, so the time goes to launching them, not to arithmetic; and the rows of a
    teacher-forced decode are independent, so feeding several batches as one computes the same
    losses to float rounding (tests/test_evaluate.py) in well under half the time
    (docs/ablations.md, the studies' time). Not for the served feed, whose left pads depend on a
    row's place in its batch."""
    groups: list[list] = []
    for x, y in batches:
        last = groups[-1] if groups else None
        if last and last[0][0].shape == x.shape and \
                (len(last) + 1) * x.numel() <= merge_tokens:
            last.append((x, y))
        else:
            groups.append([(x, y)])
    return [(torch.cat([x for x, _ in g]), torch.cat([y for _, y in g])) if len(g) > 1 else g[0]
            for g in groups]


def _one_at_a_time(model, x: torch.Tensor, static: bool):
    """Logits [B, T, V] of x fed one token at a time through a Decoder; every token scored."""
    decoder = Decoder(model, x.size(0), use_cache=True, static=static)
    logits = torch.stack([decoder.next_logits(x[:, :t + 1]) for t in range(x.size(1))], dim=1)
    return logits, torch.ones_like(x, dtype=torch.bool)


def _served(model, x: torch.Tensor, static: bool):
    """A server's second batch of prompts: each row's second half decoded first; then, through
    the same decoder restarted, its first half left-padded by pad[b] = b % (T / 4) tokens (id
    0, never seen; prompts of different lengths), one token at a time. Logits [B, T, V] at
    each real token's index of x: row b's first T / 2 - pad[b] tokens, which alone are scored."""
    B, T = x.shape
    half = T // 2
    pad = torch.arange(B, device=x.device) % max(half // 2, 1)  # [B]
    t = torch.arange(half, device=x.device)
    source = (t[None, :] - pad[:, None]).clamp_min(0)  # [B, half]: slot s holds x[b, s - pad[b]]
    prompt = torch.where(t[None, :] >= pad[:, None], x[:, :half].gather(1, source), 0)
    decoder = Decoder(model, B, use_cache=True, static=static)
    decoder.next_logits(x[:, half:])  # the first batch, all at once
    decoder.restart(pad)  # a new batch: the correct layer empties the cache
    steps = torch.stack([decoder.next_logits(prompt[:, :s + 1]) for s in range(half)], dim=1)
    index = (t[None, :] + pad[:, None]).clamp_max(half - 1)  # [B, half]: x[b, t] at t + pad[b]
    logits = steps.gather(1, index[..., None].expand(-1, -1, steps.size(-1)))  # [B, half, V]
    logits = torch.cat([logits, logits.new_zeros(B, T - half, logits.size(-1))], dim=1)
    return logits, torch.arange(T, device=x.device)[None, :] < half - pad[:, None]


def _chunks(model, x: torch.Tensor, static: bool):
    """x fed through a KV cache in chunks of the model's window (8 keys without one), as a
    prompt is prefilled in pieces; every token scored."""
    cache = model.new_cache(x.size(0), static=static)
    size = model.cfg.window or 8
    return torch.cat([model(piece, cache=cache)[0] for piece in x.split(size, dim=1)], 1), \
        torch.ones_like(x, dtype=torch.bool)


FEEDS = {CachedEval.tokens: _one_at_a_time, CachedEval.served: _served,
         CachedEval.chunks: _chunks}


def bits_per_char(nats_per_token: float, n_tokens: int, n_chars: int) -> float:
    """Convert a per-token loss to bits per character, comparable across tokenizers."""
    return nats_per_token * n_tokens / n_chars / math.log(2)


@torch.no_grad()
def attention_diagnostics(model, x: torch.Tensor, amp) -> list[dict]:
    """Per layer: mean over rows of the largest attention weight, the mean row entropy
    normalised by log(number of visible keys) (1 = uniform over the past, 0 = one-hot), and the
    future weight (`attention_maps.future_weight`: exactly 0 for a causal mask, large for a leak).

    A saturated softmax shows as max weight near 1 and entropy near 0. Row 0 (one visible key)
    is left out of the entropy. Everything is computed where the weights live and read back
    to the host once, at the end. The weights are the model's own: a leaky variant's leak.
    """
    was_training = model.training
    model.eval()
    with amp:
        _, _, weights = model(x.to(next(model.parameters()).device), return_weights=True)
    model.train(was_training)
    stats = []
    if any(w is None for w in weights):  # a learner's layer returns none (train.py your_layer=)
        return []
    for layer_weights in weights:  # [B, h, T, T]
        w = layer_weights.float()
        T = w.size(-1)
        visible = torch.arange(2, T + 1, device=w.device, dtype=w.dtype)  # [T-1] keys of rows 1..
        entropy = -(w * torch.log(w.clamp_min(1e-12))).sum(-1)[..., 1:]  # [B, h, T-1]
        stats.append(torch.stack([w.max(dim=-1).values.mean(),
                                  (entropy / torch.log(visible)).mean(),
                                  future_weight(layer_weights)]))
    values = torch.stack(stats).tolist()  # [n_layer, 3], one host sync
    return [{"max_weight": m, "entropy": e, "future_weight": f} for m, e, f in values]


def qk_grad_norms(model) -> torch.Tensor:
    """[n_layer, 2]: the gradient norms of W_Q and W_K in each layer, left on the device.

    Call after backward and before clipping: clipping would scale large gradients down to
    the clip threshold, hiding exactly the layers whose gradients blow up.
    """
    norms = []
    for block in model.blocks:
        if not isinstance(block.attn, CausalSelfAttention):  # a learner's layer (your_layer=)
            return torch.zeros(0, 2, device=block.ln_1.weight.device)
        weight = block.attn.qkv.weight
        grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
        q, k, _ = block.attn.qkv_rows  # qkv stacks W_Q, W_K, W_V: rows [0, q), [q, q + k), ...
        norms.append(torch.stack([grad[:q].norm(), grad[q:q + k].norm()]))
    return torch.stack(norms).float()


def rising_validation(history: list, patience: int) -> bool:
    """Whether the last `patience` evaluations each raised the validation loss while each
    lowered the training loss. history: [step, val loss, train loss] per evaluation."""
    if patience <= 0 or len(history) <= patience:
        return False
    recent = history[-patience - 1:]
    pairs = list(zip(recent, recent[1:]))
    return all(b[1] > a[1] for a, b in pairs) and all(b[2] < a[2] for a, b in pairs)


def sample_text(model, tokenizer, t, seed: int, device: torch.device, amp) -> str:
    """A short sample from the current weights (t: the run's TrainConfig: sample_prompt,
    sample_tokens, sample_temperature), from its own generator: the training RNG is left
    untouched, so sampling cannot change the run."""
    prompt = tokenizer.encode(t.sample_prompt).ids or [0]
    gen = seeded_generator(seed, device)
    with amp:
        ids = [int(i) for i in model.generate(torch.tensor([prompt], device=device),
                                              t.sample_tokens, temperature=t.sample_temperature,
                                              generator=gen)]
    return tokenizer.decode(prompt + ids)
