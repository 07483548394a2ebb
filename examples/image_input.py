"""Image input: prompts with images on a DeepSeek-V4.1 checkpoint with a vision tower. By default the
tiny test model tests/goldens/v41/mini6vl (random weights: the text it writes is noise, but every step is
the real one: image decoding and grid choice, the ViT and aligner, the image spans in the prompt).

    python examples/image_input.py [--model DIR] [--image PATH ...]

Each image goes where the prompt has a placeholder (`<image>`, or the model's own `<｜deepseek_image｜>`),
in order; an image is a PIL.Image, encoded bytes or a file path.
"""

import argparse
import io
import os

from PIL import Image, ImageDraw

from deepinfer import LLM, SamplingParams

TINY_VL = os.path.join(os.path.dirname(__file__), "..", "tests", "goldens", "v41", "mini6vl")


def drawn_image(width: int, height: int, color: str) -> bytes:
    """A small PNG made here, so the example needs no files."""
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).ellipse((width // 4, height // 4, 3 * width // 4, 3 * height // 4), fill=color)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=TINY_VL, help="a DeepSeek-V4.1 directory with a vision_config")
    parser.add_argument("--image", nargs="*", help="image files (default: two drawn here)")
    args = parser.parse_args()
    images = args.image or [drawn_image(120, 40, "red"), drawn_image(30, 90, "blue")]
    llm = LLM(args.model, max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    placeholders = " and ".join(["<image>"] * len(images))
    prompts = [
        # vLLM's shape: the images ride in the prompt dict
        {"prompt": f"Compare {placeholders}: which is wider?", "multi_modal_data": {"image": images}},
        # a text prompt in the same batch
        "def lookup(self, tokens):",
    ]
    for out in llm.generate(prompts, params, use_tqdm=False):
        print(f"--- {out.prompt!r}: {len(out.prompt_token_ids)} prompt positions -> {out.outputs[0].text!r}")
    # upstream's multi_modal_data argument: one dict (or None) per prompt
    out = llm.generate([f"One image: {'<image>'}"], params, multi_modal_data=[{"image": images[0]}], use_tqdm=False)
    print(f"--- one image: {len(out[0].prompt_token_ids)} prompt positions -> {out[0].outputs[0].text!r}")
    print("encoder runs:", llm.stats()["num_encoded_items"])


if __name__ == "__main__":
    main()
