"""The engine's model-neutral side of multimodal prompts: placeholder text becomes the model's one
placeholder id (whatever the tokenizer makes of it), and the text around it tokenizes as it would
around a special token."""

from __future__ import annotations

from deepinfer.core.tokenizer import Tokenizer
from v41_goldens import VL_CONFIG, checkpoint_dir

PLACEHOLDERS = {"<｜deepseek_image｜>": 511, "<image>": 511}


def test_placeholders_become_their_id():
    tok = Tokenizer(checkpoint_dir(VL_CONFIG), bos_token_id=0)  # knows <｜deepseek_image｜> as id 511
    text = "look: <｜deepseek_image｜> and then <｜deepseek_image｜>, fine"
    assert tok.encode(text, placeholders=PLACEHOLDERS) == tok.encode(text)  # the tokenizer's own split
    alias = tok.encode("look: <image> and then <image>, fine", placeholders=PLACEHOLDERS)
    assert alias == tok.encode(text)
    assert tok.encode("<image>", placeholders=PLACEHOLDERS) == [0, 511]  # BOS even before a leading placeholder
    assert tok.encode("<image>x", add_special_tokens=False, placeholders=PLACEHOLDERS)[0] == 511
    assert 511 not in tok.encode("look: <image>")  # without placeholders it is just text
