"""moechat.engine: loading, two-tier MoE execution, speculative decoding. Never imports the UI."""
