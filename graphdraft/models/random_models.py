"""Random-weight model pairs (demo fallback, tests, soak): a Llama target and its EAGLE-3 head."""

from __future__ import annotations

import torch

from graphdraft.config import ModelConfig
from graphdraft.models.eagle3 import Eagle3DraftHead
from graphdraft.models.layers import init_random_
from graphdraft.models.llama import LlamaForCausalLM


def random_model_pair(target_cfg: ModelConfig, head_cfg: ModelConfig, dtype: torch.dtype,
                      seed: int, std: float, hot_token_ids: torch.Tensor | None = None,
                      device: str | torch.device | None = None,
                      ) -> tuple[LlamaForCausalLM, Eagle3DraftHead]:
    """Target initialised with `seed`, head with `seed + 1`, then the head shares (not copies)
    the target's embedding. The head is initialised with its own embedding first: built
    around the target's storage, its initialisation would overwrite the target's embedding.

    `device` None: the current default device. Both models are built and drawn there
    (`init_random_` draws on the parameters' device: no host fp32 copy of the weights)."""
    dev = torch.device(device) if device is not None else torch.get_default_device()
    with dev:
        target = LlamaForCausalLM(target_cfg, dtype)
        init_random_(target, seed, std=std)
        head = Eagle3DraftHead(head_cfg, dtype, hot_token_ids=hot_token_ids)
        init_random_(head, seed + 1, std=std)
    head.to(dev)  # a hot_token_ids passed from another device
    head.embed_tokens = target.embed_tokens
    return target, head
