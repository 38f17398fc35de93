"""Training a draft head on cached target features, with EAGLE-3's training-time test.

Step k = 0 reads the target's fused features at t with the embedding of token t + 1 and predicts
token t + 2; step k >= 1 reads the head's own output of step k - 1 at t with token t + 1 + k and
predicts token t + 2 + k, as it will when drafting k tokens ahead. Its query sits at position
t + k and sees the step-0 entries at positions <= t plus its own earlier steps' entries at t
(positions t + 1 .. t + k): exactly the cache the drafter has at that depth. The loss at each step
is the cross-entropy to the target's distribution over the draft vocabulary (soft labels), steps
weighted 0.8^k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.drafting.head import DraftHead
from specdec.training.feature_parts import FeatureParts
from specdec.training.head_data import HeadFeatures

STEP_WEIGHT = 0.8


@dataclass(frozen=True)
class HeadLoss:
    loss: torch.Tensor  # scalar, weighted over steps
    agreement: list[float]  # per step: head's top token == the target's greedy token


def expand_kv(tensor: torch.Tensor, groups: int) -> torch.Tensor:  # [B, kv, ...] -> [B, kv * groups, ...]
    return tensor.repeat_interleave(groups, dim=1) if groups > 1 else tensor


def unrolled_loss(head: DraftHead, batch: HeadFeatures, output_rows: torch.Tensor, steps: int) -> HeadLoss:
    """output_rows: [draft_vocab, hidden], the target's output rows of the draft vocabulary (frozen)."""
    c, layer = head.config, head.midlayer
    tokens, length = batch.tokens, batch.tokens.shape[1]
    pairs = length - 1  # pair t: features at t, token t + 1
    device = head.fc.weight.device
    features = head.fc(batch.features[:, :pairs].float().to(device))  # [B, T, hidden]
    embeds_all = F.embedding(tokens.to(device), head.embed_weight)  # [B, S, hidden]
    labels_logits = batch.final.float().to(device) @ output_rows.T  # [B, S, draft_vocab]
    groups = c.num_heads // c.num_kv_heads
    scale = 1.0 / math.sqrt(c.head_dim)
    base = torch.arange(pairs, device=device)
    causal = base[None, :] <= base[:, None]  # [T, T]: step-0 key j visible to query t when j <= t
    keys0: torch.Tensor | None = None  # step 0's keys and values [B, H, T, d], seen by every step
    values0: torch.Tensor | None = None
    diagonal_keys, diagonal_values = [], []  # steps >= 1: [B, H, T, d] each, seen only at the same t
    total: torch.Tensor | None = None  # the weighted sum of the steps' losses
    weights, agreement = 0.0, []
    greedy = batch.greedy.to(device)
    for step in range(steps):
        valid = pairs - step  # pairs whose label (the target at t + 1 + step) exists
        if valid <= 0:
            break
        embeds = embeds_all[:, 1 + step : 1 + step + valid]
        if valid < pairs:
            embeds = F.pad(embeds, (0, 0, 0, pairs - valid))
        cos, sin = head.rope(base + step)  # queries at t + step
        q, k, v = layer.queries_keys_values(embeds.reshape(-1, c.hidden_size), features.reshape(-1, c.hidden_size),
                                            cos.repeat(tokens.shape[0], 1), sin.repeat(tokens.shape[0], 1))
        batch_size = tokens.shape[0]
        q, k, v = (x.view(x.shape[0], batch_size, pairs, c.head_dim).transpose(0, 1) for x in (q, k, v))  # [B, h, T, d]
        if step == 0:
            keys0, values0 = expand_kv(k, groups), expand_kv(v, groups)
        else:
            diagonal_keys.append(expand_kv(k, groups))
            diagonal_values.append(expand_kv(v, groups))
        assert keys0 is not None and values0 is not None, "step 0 sets them"
        scores = (q @ keys0.transpose(-1, -2)) * scale  # [B, H, T, T]
        scores = scores.masked_fill(~causal, float("-inf"))
        diagonal = [(q * key).sum(-1, keepdim=True) * scale for key in diagonal_keys]  # [B, H, T, 1] each
        weights_all = torch.cat([scores, *diagonal], dim=-1).softmax(-1)
        attended = weights_all[..., :pairs] @ values0
        for index, value in enumerate(diagonal_values):
            attended = attended + weights_all[..., pairs + index : pairs + index + 1] * value
        attended = attended.transpose(1, 2).reshape(batch_size * pairs, -1)
        out = layer.finish(features.reshape(-1, c.hidden_size), attended).view(batch_size, pairs, -1)
        logits = head.logits(out[:, :valid])  # [B, valid, draft_vocab]
        target_probs = labels_logits[:, 1 + step : 1 + step + valid].softmax(-1)
        loss = -(target_probs * logits.log_softmax(-1)).sum(-1).mean()
        weight = STEP_WEIGHT**step
        total, weights = weight * loss if total is None else total + weight * loss, weights + weight
        with torch.no_grad():
            drafted = head.draft_token_ids[logits.argmax(-1)]
            agreement.append(float((drafted == greedy[:, 1 + step : 1 + step + valid]).float().mean()))
        features = out  # the next step reads the head's own output at the same t
    if total is None:
        raise ValueError(f"head training needs windows of at least 2 tokens, got {length}")
    return HeadLoss(total / weights, agreement)


@torch.no_grad()
def evaluate(
    head: DraftHead, data: HeadFeatures, output_rows: torch.Tensor, steps: int, batch_size: int = 8
) -> HeadLoss:
    """Loss and per-step top-1 agreement over every held-out sequence."""
    losses, agreements, count = [], [], 0
    for first in range(0, len(data), batch_size):
        batch = data.select(slice(first, first + batch_size))
        result = unrolled_loss(head, batch, output_rows, steps)
        size = len(batch)
        losses.append(float(result.loss) * size)
        agreements.append([value * size for value in result.agreement])
        count += size
    per_step = [sum(values) / count for values in zip(*agreements, strict=True)]
    return HeadLoss(torch.tensor(sum(losses) / count), per_step)


def sample_batch(data: HeadFeatures | FeatureParts, size: int, generator: torch.Generator) -> HeadFeatures:
    """``size`` sequences drawn with replacement (the same draws from a FeatureParts as from its
    parts concatenated)."""
    return data.select(torch.randint(0, len(data), (size,), generator=generator))


def learning_rate(step: int, steps: int, peak: float, warmup: int = 50) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
