"""Qwen3-MoE (Qwen3-30B-A3B): Qwen3's attention (q/k norms), a softmax router over every expert, each token's
top-k renormalised when norm_topk_prob, the sparse layers every decoder_sparse_step-th minus mlp_only_layers."""

from scaletrain.model.family.qwen2 import qwen_layer_pattern, qwen_write
from scaletrain.model.family.spec import Family, Fields, GGUFLayout, flagged_window
from scaletrain.model.shape import is_moe_layer


def moe_read(f: Fields, n_layers: int, experts_field: str = "num_experts") -> dict:
    """The MoE fields of a Qwen-MoE / OLMoE config.json. The sparse layers are listed (moe_layers), the one form
    both decoder_sparse_step and mlp_only_layers read back to, so a round trip gives the same config."""
    step, dense = int(f.get("decoder_sparse_step") or 1), set(f.get("mlp_only_layers") or [])
    experts = f.get(experts_field) or f.get("num_local_experts")  # transformers 5 saves num_local_experts
    if not experts:
        raise f.refuse(experts_field, "a mixture of experts needs experts")
    return dict(moe_experts=int(experts), moe_top_k=int(f.need("num_experts_per_tok")),
                moe_hidden_dim=int(f.need("moe_intermediate_size")), moe_renormalize=bool(f.get("norm_topk_prob")),
                moe_layers=[i for i in range(n_layers) if i not in dense and (i + 1) % step == 0],
                moe_balance_coef=float(f.get("router_aux_loss_coef")))


def moe_write(cfg, experts_field: str = "num_experts") -> dict:
    """Our MoE options as Qwen-MoE's fields: every layer a candidate (step 1), the dense ones listed."""
    return {experts_field: cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
            "moe_intermediate_size": cfg.moe_hidden_dim or cfg.ffn_hidden_dim, "norm_topk_prob": cfg.moe_renormalize,
            "decoder_sparse_step": 1, "router_aux_loss_coef": cfg.moe_balance_coef,
            "mlp_only_layers": [i for i in range(cfg.n_layers) if not is_moe_layer(cfg, i)]}


FAMILY = Family(
    model_type="qwen3_moe", hf_class="Qwen3MoeForCausalLM",
    defaults=dict(tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                  use_sliding_window=False, max_window_layers=28, head_dim=128, hidden_act="silu",
                  decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False, router_aux_loss_coef=0.001),
    read=lambda f, n_layers: dict(qk_norm=True, **moe_read(f, n_layers)),
    write=lambda cfg, sliding: dict(attention_bias=False, **qwen_write(cfg, sliding), **moe_write(cfg)),
    window=flagged_window, layer_pattern=qwen_layer_pattern,
    block_modules={"feed_forward.router": "mlp.gate"},
    experts={"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
    # llama.cpp's qwen3moe: the experts' width its own key (the converter's add_expert_feed_forward_length)
    gguf=GGUFLayout(arch="qwen3moe", experts=True, renormalize=True,
                    metadata=lambda writer, cfg: writer.add_expert_feed_forward_length(
                        cfg.moe_hidden_dim or cfg.ffn_hidden_dim)),
)
