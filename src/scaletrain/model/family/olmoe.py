"""OLMoE (OLMoE-1B-7B): RMSNorm over each token's whole query and key projections (not per head), every layer a
softmax router over every expert whose top-k weights are not renormalised (norm_topk_prob false as published)."""

from scaletrain.model.family.spec import Family, Fields, GGUFLayout
from scaletrain.model.shape import head_width


def _read(f: Fields, n_layers: int) -> dict:
    if f.get("clip_qkv") is not None:  # OLMo's clamp of q, k and v
        raise f.refuse("clip_qkv", "q, k and v are not clamped")
    return dict(qk_norm=True, qk_norm_width="projection", moe_experts=int(f.need("num_experts")),
                moe_top_k=int(f.need("num_experts_per_tok")), moe_hidden_dim=int(f.need("intermediate_size")),
                moe_renormalize=bool(f.get("norm_topk_prob")), moe_balance_coef=float(f.get("router_aux_loss_coef")))


def _gguf_refuse(cfg) -> str | None:
    """llama.cpp's olmoe takes q, k and v as wide as the model (its tensors {dim, dim}, the q/k norms {dim})."""
    kv_heads = cfg.n_kv_heads or cfg.n_heads
    if cfg.n_heads * head_width(cfg) != cfg.dim or kv_heads != cfg.n_heads:
        return (f"{cfg.n_heads} heads of {head_width(cfg)} with {kv_heads} kv heads (its q, k and v are "
                f"dim = {cfg.dim} wide)")
    return None


def _write(cfg, sliding: list[bool]) -> dict:
    return dict(attention_bias=False, clip_qkv=None, num_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k,
                intermediate_size=cfg.moe_hidden_dim or cfg.ffn_hidden_dim, norm_topk_prob=cfg.moe_renormalize,
                router_aux_loss_coef=cfg.moe_balance_coef)


FAMILY = Family(
    model_type="olmoe", hf_class="OlmoeForCausalLM",
    defaults=dict(tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
                  hidden_act="silu", norm_topk_prob=False, router_aux_loss_coef=0.01, clip_qkv=None),
    read=_read, write=_write,
    window=lambda f: 0,  # OlmoeConfig has no sliding window
    block_modules={"feed_forward.router": "mlp.gate"},
    experts={"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
    gguf=GGUFLayout(arch="olmoe", experts=True, renormalize=False, refuse=_gguf_refuse),
)
