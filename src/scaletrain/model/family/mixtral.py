"""Mixtral: Mistral's attention, every layer sparse (block_sparse_moe): a softmax router over every expert, each
token's top-k renormalised to sum to 1, the experts w1 (gate), w3 (up), w2 (down) of width intermediate_size."""

from scaletrain.model.family.spec import Family, Fields, GGUFLayout


def _read(f: Fields, n_layers: int) -> dict:
    if f.get("router_jitter_noise"):  # multiplicative noise on the router's input while training
        raise f.refuse("router_jitter_noise", "the router takes its input as it is")
    return dict(moe_experts=int(f.need("num_local_experts")), moe_top_k=int(f.need("num_experts_per_tok")),
                moe_hidden_dim=int(f.need("intermediate_size")), moe_renormalize=True,
                moe_balance_coef=float(f.get("router_aux_loss_coef")))


def _write(cfg, sliding: list[bool]) -> dict:
    # every layer sparse and renormalised: the rest of our MoE options are read back and compared (families.py)
    return dict(sliding_window=cfg.sliding_window or None, num_local_experts=cfg.moe_experts,
                num_experts_per_tok=cfg.moe_top_k, intermediate_size=cfg.moe_hidden_dim or cfg.ffn_hidden_dim,
                router_aux_loss_coef=cfg.moe_balance_coef, router_jitter_noise=0.0)


FAMILY = Family(
    model_type="mixtral", hf_class="MixtralForCausalLM",
    defaults=dict(tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
                  max_position_embeddings=131072, hidden_act="silu", router_aux_loss_coef=0.001,
                  router_jitter_noise=0.0),
    read=_read, write=_write,
    block_modules={"feed_forward.router": "block_sparse_moe.gate"},
    experts={"w1": "w1", "w2": "w2", "w3": "w3"}, experts_module="block_sparse_moe.experts",
    native_modules=(("mlp.", "block_sparse_moe."),),
    # llama.cpp's converter writes Mixtral as its llama architecture with experts (adjacent-pair rotary, as Mistral)
    gguf=GGUFLayout(arch="llama", interleave_rotary=True, experts=True, renormalize=True),
)
