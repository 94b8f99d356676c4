"""The model shapes the step benchmarks run: the default recipe's (hidden 64, seq 64) and a larger one,
as recipe overrides (one list, so every benchmark's "large" is the same model)."""

SHAPES = {
    "default": [],
    "large": ["model.hidden_size=256", "model.seq_length=256", "model.ffn_hidden_size=512",
              "model.moe.ffn_hidden_size=256", "model.moe.shared_expert_ffn_hidden_size=256"],
}
