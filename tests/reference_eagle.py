"""A slow, obviously correct EAGLE-3 drafter: per request, token by token, dense KV, float64.

It reads the head's weights and keeps, per request, a dict position -> (k, v).
Nothing is paged, batched, padded or fused. Draft tokens are teacher-forced
from the drafter under test (`check` accepts the drafter's choice when it is
the reference's argmax up to a float tolerance), so both follow one chain.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class ReferenceEagle3:
    def __init__(self, head) -> None:
        self.cfg = cfg = head.config
        self.w = {n: p.detach().to(torch.float64) for n, p in head.named_parameters()}
        self.hot = head.hot_token_ids
        self.h, self.hq, self.hkv, self.d = (cfg.hidden_size, cfg.num_attention_heads,
                                             cfg.num_key_value_heads, cfg.head_dim)
        self.kv: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = defaultdict(dict)

    # --- math ---------------------------------------------------------------
    def _rms(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean() + self.cfg.rms_norm_eps) * self.w[name]

    def _rope(self, x, pos):  # x [heads, D]
        d = self.d
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = pos * inv
        cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
        rot = torch.cat([-x[:, d // 2:], x[:, : d // 2]], dim=-1)
        return x * cos + rot * sin

    def write(self, slot: int, token: int, hidden: torch.Tensor, pos: int):
        """KV of one token at `pos`; returns (rotated q [Hq, D], hidden after fc [H])."""
        w = self.w
        h = hidden.to(torch.float64)
        if h.numel() != self.h:
            h = w["fc"] @ h
        e = w["embed_tokens"][token]
        x = torch.cat([self._rms(e, "midlayer.input_layernorm.weight"),
                       self._rms(h, "midlayer.hidden_norm.weight")])
        qkv = w["midlayer.self_attn.qkv_proj"] @ x
        qs, ks = self.hq * self.d, self.hkv * self.d
        q = self._rope(qkv[:qs].view(self.hq, self.d), pos)
        k = self._rope(qkv[qs: qs + ks].view(self.hkv, self.d), pos)
        v = qkv[qs + ks:].view(self.hkv, self.d)
        self.kv[slot][pos] = (k, v)
        return q, h

    def finish(self, slot: int, q: torch.Tensor, h: torch.Tensor, kv_len: int):
        """Attend over positions [0, kv_len) of `slot`; returns (logits [Vd], pre-norm hidden [H])."""
        w = self.w
        ks = torch.stack([self.kv[slot][p][0] for p in range(kv_len)])  # [L, Hkv, D]
        vs = torch.stack([self.kv[slot][p][1] for p in range(kv_len)])
        g = self.hq // self.hkv
        out = []
        for head in range(self.hq):
            kh, vh = ks[:, head // g], vs[:, head // g]
            p = torch.softmax(kh @ q[head] / self.d ** 0.5, dim=0)
            out.append(p @ vh)
        attn = w["midlayer.self_attn.o_proj"] @ torch.cat(out)
        r = attn + h
        n = self._rms(r, "midlayer.post_attention_layernorm.weight")
        gu = w["midlayer.mlp.gate_up_proj"] @ n
        f = gu.shape[0] // 2
        m = w["midlayer.mlp.down_proj"] @ (torch.nn.functional.silu(gu[:f]) * gu[f:])
        pre = m + r
        logits = w["lm_head"] @ self._rms(pre, "norm.weight")
        return logits, pre

    def to_target(self, draft_id: int) -> int:
        return int(self.hot[draft_id]) if self.hot is not None else draft_id

    def check(self, logits: torch.Tensor, got_target_id: int, where: str) -> None:
        """The drafter's token must be the reference argmax (up to float ties)."""
        ids = range(logits.shape[0])
        matches = [i for i in ids if self.to_target(i) == got_target_id]
        assert matches, f"{where}: token {got_target_id} is not in the draft vocab map"
        best = float(logits.max())
        tol = 1e-4 * max(1.0, abs(best))
        assert float(logits[matches[0]]) >= best - tol, (
            f"{where}: drafter chose {got_target_id} (ref logit {float(logits[matches[0]]):.6f}), "
            f"reference argmax {self.to_target(int(logits.argmax()))} ({best:.6f})")

    # --- one drafter call, one request -----------------------------------------
    def draft_row(self, slot: int, positions: list[int], ids: list[int], hiddens: torch.Tensor,
                  gather: int, kv_len: int, write_start: int, steps: int, got: list[int],
                  where: str) -> None:
        """Check one request's `next_tokens` row `got` ([steps + 1] target ids).

        positions/ids/hiddens: this call's first-step tokens of the row; `gather` the
        index of the row that goes to the LM head; `kv_len` its KV length.
        """
        q_g = h_g = None
        for j, (pos, tok) in enumerate(zip(positions, ids, strict=True)):
            q, h = self.write(slot, tok, hiddens[j], pos)
            if j == gather:
                q_g, h_g = q, h
        assert got[0] == ids[gather], f"{where}: column 0 {got[0]} != last verified {ids[gather]}"
        logits, hidden = self.finish(slot, q_g, h_g, kv_len)
        self.check(logits, got[1], f"{where} step 1")
        for i in range(1, steps):
            pos = write_start + i - 1
            q, h = self.write(slot, got[i], hidden, pos)
            logits, hidden = self.finish(slot, q, h, pos + 1)
            self.check(logits, got[i + 1], f"{where} step {i + 1}")
