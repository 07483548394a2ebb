"""DeepSeek-V4.1 (DeepseekV41ForCausalLM)."""
