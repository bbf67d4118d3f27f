"""What the driver needs of a vision-language model's processor each step (--max_images_per_prompt > 0).

    VisionPrompts(model_path)
      .tensors(prompt)       the prompt's image tensors (pixel_values, ...) for the trainers' forwards, or None
      .banned_token_ids      ids no response may contain (the image placeholders): the engines ban them

The executor (rollout/executor.py) calls tensors() once per prompt of a step and hands the result to every sample
of that prompt, so each image is processed once per step in the driver and travels to the ranks as tensors.
"""

from __future__ import annotations

from typing import Optional


class VisionPrompts:
    def __init__(self, model_path: str):
        from orlhf.inputs.images import image_token_ids, load_processor  # PIL and the processor: VLM runs only

        self.processor = load_processor(model_path)
        self.banned_token_ids: tuple[int, ...] = tuple(image_token_ids(self.processor, self.processor.tokenizer))

    def tensors(self, prompt) -> Optional[dict]:
        from orlhf.inputs.images import prompt_vision

        return prompt_vision(self.processor, prompt)


def vision_prompts(cfg) -> Optional[VisionPrompts]:
    """The run's VisionPrompts (its actor's processor) when it trains on image prompts, else None."""
    return VisionPrompts(cfg.data.pretrain) if cfg.data.max_images_per_prompt > 0 else None
