"""DeepSeek-V4.1's vision settings: the `vision_config` block of config.json and the top-level
`image_token_id`, parsed and validated.

The released keys map onto DeepSeek's `ModelArgs.vision_*` fields (reference/DEEPSEEK_V41.md, "HF
config"): num_hidden_layers -> vision_n_layers, hidden_size -> vision_dim, num_attention_heads ->
vision_n_heads, intermediate_size -> vision_inter_dim, max_image_tokens -> vision_max_n_token, every
other key -> vision_<key>. A key the block leaves out takes the reference's ModelArgs default.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.models.base import ConfigError

IMAGE_TOKEN_ID = 129264  # <｜deepseek_image｜>: every position of an image span carries it
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
NORM_EPS = 1e-6  # the ViT's RMSNorm eps (fixed in the reference, not a config key)


@dataclass(frozen=True, slots=True)
class VisionConfig:
    num_hidden_layers: int = 0  # 0: no vision tower
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024  # LLM positions an image span may take, its markers included
    min_pixels: int = 544 * 544  # smaller images are scaled up to about this many pixels
    max_wh_ratio: float | None = None  # wider images are squeezed (stretched, not padded) to this ratio
    image_token_id: int = IMAGE_TOKEN_ID
    text_hidden_size: int = 0  # the aligner's output: the language model's hidden size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rope_dim(self) -> int:
        """Rotary angles per position axis: head_dim / 2 channels turn with the row index, as many
        with the column index (2-D RoPE over the whole head)."""
        return self.head_dim // 2

    @classmethod
    def from_dict(cls, data: dict, text_hidden_size: int, source: str = "config") -> "VisionConfig | None":
        """The vision settings of a whole config.json (`data`), or None when it has no vision tower."""
        block = data.get("vision_config")
        if block is None:
            return None
        if not isinstance(block, dict):
            raise ConfigError(f"{source}: 'vision_config' must be an object, got {block!r}")
        fields = {"num_hidden_layers": int, "hidden_size": int, "num_attention_heads": int, "intermediate_size": int,
                  "patch_size": int, "rope_theta": float, "downsample_ratio": int, "max_image_tokens": int,
                  "min_pixels": int, "max_wh_ratio": float}
        values = {}
        for key, kind in fields.items():
            if block.get(key) is None:
                continue
            value = block[key]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = value if key == "max_wh_ratio" else float(value)  # an int ratio stays exact
            least = 0 if key == "num_hidden_layers" else 1e-30  # 0 layers: no vision tower
            kinds = (kind, int) if kind is float else kind
            if not isinstance(value, kinds) or isinstance(value, bool) or value < least:
                raise ConfigError(f"{source}: vision_config {key!r} must be a positive {kind.__name__}, got {value!r}")
            values[key] = value
        token = data.get("image_token_id", IMAGE_TOKEN_ID)
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ConfigError(f"{source}: 'image_token_id' must be a token id, got {token!r}")
        cfg = cls(**values, image_token_id=token, text_hidden_size=text_hidden_size)
        if cfg.num_hidden_layers == 0:
            return None
        if cfg.hidden_size % cfg.num_attention_heads or cfg.head_dim % 4:
            raise ConfigError(f"{source}: vision_config hidden_size {cfg.hidden_size} over {cfg.num_attention_heads} "
                              "heads must give a head size divisible by 4 (2-D rotary: two axes of channel pairs)")
        # the smallest span: one row of one token (start, token, new line, end)
        if cfg.max_image_tokens < 4:
            raise ConfigError(f"{source}: vision_config 'max_image_tokens' is {cfg.max_image_tokens}; an image "
                              "span takes at least 4 positions")
        return cfg
