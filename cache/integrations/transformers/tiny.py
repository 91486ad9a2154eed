"""Tiny random-weight ``transformers`` hybrid models, for tests and ``blocktrie demo``.

Imports neither torch nor transformers until a model is built (the CLI's
parser reads `TINY_CONFIGS`).

Each is built from a config (no hub access): hidden size <= 64, <= 4 layers,
vocabulary of `VOCAB_SIZE`, and both kinds of layer (attention and SSM /
linear attention) wherever the architecture has them. The weights depend only
on ``seed``. These configs are for building models; nothing in
`cache.integrations.transformers` reads them (the layout is discovered).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["TINY_CONFIGS", "VOCAB_SIZE", "random_model", "tiny_model"]

VOCAB_SIZE = 128

_MAMBA2_MIXER = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8}
_MAMBA2_MIXER |= {"mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8}
_ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # Pure Mamba-2: conv + recurrent state, no attention.
    "mamba2": {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_heads": 4,
        "head_dim": 16,
        "state_size": 8,
        "n_groups": 1,
        "conv_kernel": 4,
        "chunk_size": 8,
        "expand": 2,
        "time_step_rank": 4,
    },
    # Mamba-2 layers around one attention layer.
    "bamba": {
        "num_hidden_layers": 3,
        "hidden_size": 32,
        "attn_layer_indices": [1],
        **_ATTENTION,
        **_MAMBA2_MIXER,
    },
    # Mamba-1 layers and attention, MoE every other layer.
    "jamba": {
        "num_hidden_layers": 4,
        "hidden_size": 32,
        **_ATTENTION,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 4,
    },
    # Mamba-2 layers; "hybrid" layers add a shared attention block (KV and state in one
    # cache layer).
    "zamba2": {
        "num_hidden_layers": 4,
        "hidden_size": 32,
        "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_ngroups": 1,
        "n_mamba_heads": 4,
        "mamba_headdim": 16,
        "chunk_size": 8,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "attention_head_dim": 16,
        "num_mem_blocks": 1,
        "adapter_rank": 8,
    },
    # Attention and Mamba-2 in parallel in every layer.
    "falcon_h1": {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        **_ATTENTION,
        **_MAMBA2_MIXER,
        "mamba_d_ssm": 32,
        "mamba_d_head": 8,
    },
    # Mamba-2, MLP and attention layers.
    "nemotron_h": {
        "hidden_size": 32,
        "layers_block_type": ["linear_attention", "mlp", "full_attention", "linear_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "ssm_state_size": 8,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "chunk_size": 8,
    },
    # Gated DeltaNet (linear attention) layers and gated attention, MoE.
    "qwen3_next": {
        "num_hidden_layers": 4,
        "hidden_size": 32,
        **_ATTENTION,
        "head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "num_experts_per_tok": 2,
        "num_experts": 4,
    },
}
"""``model_type`` -> config fields of its tiny model (`VOCAB_SIZE` is added)."""


def tiny_model(name: str, *, dtype: torch.dtype | None = None, seed: int = 0) -> Any:
    """The tiny random-weight causal LM of architecture ``name`` (a key of `TINY_CONFIGS`),
    in ``dtype`` (default float64), eval mode, on the CPU; its generation config has no
    end-of-sequence token."""
    if name not in TINY_CONFIGS:
        raise ValueError(
            f"tiny_model: unknown architecture {name!r}; one of {sorted(TINY_CONFIGS)}"
        )
    return random_model(name, TINY_CONFIGS[name], dtype=dtype, seed=seed)


def random_model(
    model_type: str, fields: dict[str, Any], *, dtype: torch.dtype | None = None, seed: int = 0
) -> Any:
    """A random-weight causal LM of ``model_type`` built from ``fields`` (plus a
    `VOCAB_SIZE` vocabulary and no special tokens), in ``dtype`` (default float64),
    eval mode, on the CPU."""
    import torch

    from cache.extras import requires_extra

    with requires_extra("hf", "cache.integrations.transformers.tiny"):
        import transformers

    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB_SIZE,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **fields,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # Eager experts: the grouped_mm MoE kernel refuses float64 on the CPU.
        auto: Any = transformers.AutoModelForCausalLM
        model = auto.from_config(
            config,
            dtype=torch.float64 if dtype is None else dtype,
            experts_implementation="eager",
        )
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()
